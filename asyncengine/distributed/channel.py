"""The driver's messages to the workers, each a torch.distributed broadcast from rank 0.

A message is one fixed-size int64 tensor on the control group (gloo, CPU): the kind, the
length of its payload, two arguments, and the payload itself when it fits (the rest of a long
one follows in a second broadcast). A step's message is what the workers need and nothing
more: the block moves and the forward's inputs and attention metadata exactly as the driver's
runner flattened them (no request state, no token history). On the CPU a decode step's whole
message is one broadcast; on CUDA its per-token tensors go on the device group instead, device
to device (NCCL) with no host copy.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import torch
import torch.distributed as dist

from asyncengine.core.scheduler import SchedulerOutput
from asyncengine.distributed.parallel_state import TensorParallelGroup
from asyncengine.lora.peft import SUPPORTED_MODULES, LoRAModule, LoRAWeights
from asyncengine.worker.forward_context import AttentionMetadata

_HEADER_LEN = 4  # kind, payload length, two arguments
# payload ints carried in the message itself (8 KiB in all); a longer payload's rest follows
_INLINE_LEN = 1020
# AttentionMetadata fields a step message carries (scratch starts empty on every rank)
ENCODED_METADATA_FIELDS = frozenset(
    {"slot_mapping", "block_tables", "seq_lens", "query_start_loc", "context_lens",
     "seq_lens_list", "num_decodes", "max_seq_len", "scratch"}
)  # fmt: skip


if {f.name for f in dataclasses.fields(AttentionMetadata)} != ENCODED_METADATA_FIELDS:
    raise RuntimeError(
        "AttentionMetadata's fields changed: encode the new ones for the tensor-parallel "
        "workers in ControlChannel.send_step/recv_step, then update ENCODED_METADATA_FIELDS"
    )


class Kind(enum.IntEnum):
    SIZE_CACHE = 1  # every rank sizes its KV cache; the smallest counts win
    INITIALIZE_CACHE = 2  # args: device blocks, swap blocks
    STEP = 3  # block moves, then one forward
    MOVES = 4  # block moves of a step without a forward
    LOGITS = 5  # args: rows, hidden size; the rows follow on the device group
    SHUTDOWN = 6
    LOAD_LORA = 7  # args: slot, modules; scalings, then each module's A and B follow


@dataclasses.dataclass
class Message:
    kind: Kind
    args: tuple[int, int]
    payload: torch.Tensor  # int64


@dataclasses.dataclass
class StepInputs:
    """What a worker runs for one step."""

    moves: SchedulerOutput  # only its block moves are set
    input_ids: torch.Tensor | None = None  # None: no forward this step
    positions: torch.Tensor | None = None
    attn_metadata: AttentionMetadata | None = None
    # the forward's LoRA segments (first row, end row, slot); empty: no adapter in it
    lora_segments: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)


class ControlChannel:
    """Rank 0 sends; every other rank receives, in the same order."""

    def __init__(self, tp: TensorParallelGroup, device: str, dtype: torch.dtype) -> None:
        self.tp = tp
        self.device = device
        self.dtype = dtype

    # -- both sides ----------------------------------------------------------------------------

    def _broadcast_ints(self, values: torch.Tensor) -> None:
        dist.broadcast(values, src=0, group=self.tp.control_group)

    def _broadcast_host(self, tensor: torch.Tensor) -> None:
        """A host tensor of any dtype on the control group (an adapter's weights)."""
        dist.broadcast(tensor, src=0, group=self.tp.control_group)

    def _broadcast_device(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=0, group=self.tp.device_group)

    # -- the driver ----------------------------------------------------------------------------

    def send(
        self, kind: Kind, args: tuple[int, int] = (0, 0), payload: torch.Tensor | None = None
    ) -> None:
        length = 0 if payload is None else len(payload)
        message = torch.empty(_HEADER_LEN + _INLINE_LEN, dtype=torch.long)
        message[:_HEADER_LEN] = torch.tensor([int(kind), length, *args])
        inline = min(length, _INLINE_LEN)
        if payload is not None and inline:
            message[_HEADER_LEN : _HEADER_LEN + inline] = payload[:inline]
        self._broadcast_ints(message)
        if payload is not None and length > inline:
            self._broadcast_ints(payload[inline:].contiguous())

    def send_step(
        self,
        moves: SchedulerOutput | None,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        lora_segments: Sequence[tuple[int, int, int]] = (),
    ) -> None:
        num_tokens, (num_seqs, max_blocks) = len(input_ids), meta.block_tables.shape
        ints = [num_seqs, max_blocks, meta.num_decodes, meta.max_seq_len]
        ints += _encode_moves(moves) + meta.query_start_loc + meta.context_lens
        ints += [len(lora_segments), *(i for segment in lora_segments for i in segment)]
        per_token = torch.cat(
            [input_ids, positions, meta.slot_mapping, meta.block_tables.flatten().long()]
        )
        header = torch.tensor(ints, dtype=torch.long)
        if self.device == "cpu":  # all of it in one message, a decode step's in one broadcast
            self.send(Kind.STEP, (num_tokens, len(per_token)), torch.cat([header, per_token]))
        else:
            self.send(Kind.STEP, (num_tokens, len(per_token)), header)
            self._broadcast_device(per_token)

    def send_lora(self, slot: int, weights: LoRAWeights) -> None:
        """An adapter for a LoRA slot: its whole tensors (each rank keeps its shard)."""
        modules = sorted(weights.modules.items())
        ints = [weights.lora_int_id]
        for (layer, module), lora in modules:
            index = SUPPORTED_MODULES.index(module)
            ints += [layer, index, lora.rank, lora.b.shape[0], lora.a.shape[1]]
        self.send(Kind.LOAD_LORA, (slot, len(modules)), torch.tensor(ints, dtype=torch.long))
        scalings = [lora.scaling for _, lora in modules]
        self._broadcast_host(torch.tensor(scalings, dtype=torch.float64))
        for _, lora in modules:
            self._broadcast_host(lora.a)
            self._broadcast_host(lora.b)

    def recv_lora(self, message: Message) -> tuple[int, LoRAWeights]:
        (slot, num_modules), ints = message.args, message.payload.tolist()
        scalings = torch.empty(num_modules, dtype=torch.float64)
        self._broadcast_host(scalings)
        weights = LoRAWeights(ints[0])
        for i in range(num_modules):
            layer, module, rank, num_out, num_in = ints[1 + 5 * i : 6 + 5 * i]
            a = torch.empty(rank, num_in, dtype=self.dtype)
            b = torch.empty(num_out, rank, dtype=self.dtype)
            self._broadcast_host(a)
            self._broadcast_host(b)
            key = (layer, SUPPORTED_MODULES[module])
            weights.modules[key] = LoRAModule(a, b, float(scalings[i]))
        return slot, weights

    def send_moves(self, moves: SchedulerOutput) -> None:
        self.send(Kind.MOVES, payload=torch.tensor(_encode_moves(moves), dtype=torch.long))

    def send_logits(self, hidden: torch.Tensor) -> None:
        num_rows, hidden_size = hidden.shape
        self.send(Kind.LOGITS, (num_rows, hidden_size))
        self._broadcast_device(hidden.contiguous())

    # -- a worker ------------------------------------------------------------------------------

    def recv(self) -> Message:
        message = torch.empty(_HEADER_LEN + _INLINE_LEN, dtype=torch.long)
        self._broadcast_ints(message)
        kind, length, *args = message[:_HEADER_LEN].tolist()
        payload = message[_HEADER_LEN : _HEADER_LEN + min(length, _INLINE_LEN)]
        if length > _INLINE_LEN:
            rest = torch.empty(length - _INLINE_LEN, dtype=torch.long)
            self._broadcast_ints(rest)
            payload = torch.cat([payload, rest])
        return Message(Kind(kind), (args[0], args[1]), payload)

    def recv_step(self, message: Message) -> StepInputs:
        payload = message.payload
        if message.kind is Kind.MOVES:
            return StepInputs(_decode_moves(payload, 0)[0])
        num_tokens, num_per_token = message.args
        num_seqs, max_blocks, num_decodes, max_seq_len = payload[:4].tolist()
        moves, at = _decode_moves(payload, 4)
        lengths = payload[at : at + 2 * num_seqs + 1].tolist()
        query_start_loc, context_lens = lengths[: num_seqs + 1], lengths[num_seqs + 1 :]
        at += 2 * num_seqs + 1
        num_segments = int(payload[at])
        flat = payload[at + 1 : at + 1 + 3 * num_segments].tolist()
        lora_segments = list(zip(flat[0::3], flat[1::3], flat[2::3], strict=True))
        at += 1 + 3 * num_segments
        if self.device == "cpu":
            per_token = payload[at : at + num_per_token]
        else:
            per_token = torch.empty(num_per_token, dtype=torch.long, device=self.device)
            self._broadcast_device(per_token)
        input_ids, positions, slot_mapping, tables = per_token.split(
            [num_tokens, num_tokens, num_tokens, num_seqs * max_blocks]
        )
        seq_lens = [
            context + query_start_loc[i + 1] - query_start_loc[i]
            for i, context in enumerate(context_lens)
        ]
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=tables.view(num_seqs, max_blocks).int(),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            query_start_loc=query_start_loc,
            context_lens=context_lens,
            seq_lens_list=seq_lens,
            num_decodes=num_decodes,
            max_seq_len=max_seq_len,
        )
        return StepInputs(moves, input_ids, positions, meta, lora_segments)

    def recv_hidden(self, message: Message) -> torch.Tensor:
        num_rows, hidden_size = message.args
        hidden = torch.empty(num_rows, hidden_size, dtype=self.dtype, device=self.device)
        self._broadcast_device(hidden)
        return hidden


def _encode_moves(plan: SchedulerOutput | None) -> list[int]:
    if plan is None:
        return [0, 0, 0]
    lists = (plan.blocks_to_swap_out, plan.blocks_to_swap_in, plan.blocks_to_copy)
    ints = [len(pairs) for pairs in lists]
    for pairs in lists:
        ints += [block for pair in pairs for block in pair]
    return ints


def _decode_moves(ints: torch.Tensor, at: int) -> tuple[SchedulerOutput, int]:
    """The block moves encoded at `ints[at:]`, and where the ints after them start."""
    counts, at = ints[at : at + 3].tolist(), at + 3
    lists: list[list[tuple[int, int]]] = []
    for count in counts:
        flat = ints[at : at + 2 * count].tolist()
        lists.append(list(zip(flat[0::2], flat[1::2], strict=True)))
        at += 2 * count
    swap_out, swap_in, copy = lists
    moves = SchedulerOutput(
        blocks_to_swap_out=swap_out, blocks_to_swap_in=swap_in, blocks_to_copy=copy
    )
    return moves, at
