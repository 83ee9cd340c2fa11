"""This process's place among the tensor-parallel ranks and the two groups they talk over.

The device group carries the forward's collectives (NCCL on CUDA, gloo on CPU); the control
group (gloo, CPU tensors) carries the driver's messages. Each rank sets its own timeouts: in a
step no rank waits for another longer than `distributed_timeout_s`, but an idle worker waits
for the driver's next message without end.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from asyncengine.config import ParallelConfig

# an idle worker waits this long for the driver: in practice forever
_IDLE_TIMEOUT = datetime.timedelta(days=365)
# ranks may start minutes apart (pods being scheduled) and take minutes to load their weights
_STARTUP_TIMEOUT = datetime.timedelta(minutes=30)
_JOINED_KEY = "asyncengine/ranks_joined"


@dataclass(frozen=True)
class TensorParallelGroup:
    """Rank `rank` of `world_size`; rank 0 is the driver (the engine process)."""

    rank: int
    world_size: int
    device_group: dist.ProcessGroup
    control_group: dist.ProcessGroup

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def split(self, size: int) -> tuple[int, int]:
        """(start, length) of this rank's contiguous share of `size` (which the ranks divide)."""
        assert size % self.world_size == 0, (size, self.world_size)
        length = size // self.world_size
        return self.rank * length, length

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first, count) of the KV heads this rank holds: its share, or with fewer heads than
        ranks one head, replicated on world_size / num_kv_heads ranks (those of its queries)."""
        if num_kv_heads >= self.world_size:
            return self.split(num_kv_heads)
        return self.rank * num_kv_heads // self.world_size, 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def gather_to_driver(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `tensor` along its last dim on the driver; others get
        their own back."""
        tensor = tensor.contiguous()
        if not self.is_driver:
            dist.gather(tensor, None, dst=0, group=self.device_group)
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.gather(tensor, parts, dst=0, group=self.device_group)
        return torch.cat(parts, dim=-1)


def init_tensor_parallel(
    parallel: ParallelConfig,
    rank: int,
    init_method: str,
    device: str,
    check_workers: Callable[[], None] | None = None,
) -> TensorParallelGroup:
    """Join the ranks' rendezvous and make both groups (every rank calls this alike).

    The driver waits for every rank to join, calling `check_workers` meanwhile (it raises
    when a worker it started has died, so a crash at start-up fails at once).
    """
    step_timeout = datetime.timedelta(seconds=parallel.distributed_timeout_s)
    world_size = parallel.tensor_parallel_size
    store = _rendezvous(init_method, rank, world_size, check_workers)
    dist.init_process_group(
        backend="nccl" if device == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=step_timeout,
    )
    control_timeout = step_timeout if rank == 0 else _IDLE_TIMEOUT
    control = dist.new_group(backend="gloo", timeout=control_timeout)
    return TensorParallelGroup(rank, world_size, dist.group.WORLD, control)  # type: ignore[arg-type]


def _rendezvous(
    init_method: str, rank: int, world_size: int, check_workers: Callable[[], None] | None
) -> dist.Store:
    """torch.distributed's TCP store at `init_method` (tcp://host:port, hosted by rank 0),
    once every rank has joined it."""
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"distributed_init_method must be tcp://host:port, got {init_method!r}")
    store = dist.TCPStore(
        url.hostname, url.port, world_size, is_master=rank == 0, timeout=_STARTUP_TIMEOUT,
        wait_for_workers=False,
    )  # fmt: skip
    store.add(_JOINED_KEY, 1)
    deadline = time.monotonic() + _STARTUP_TIMEOUT.total_seconds()
    while rank == 0 and store.add(_JOINED_KEY, 0) < world_size:
        if check_workers is not None:
            check_workers()
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every tensor-parallel rank joined {init_method} in time")
        time.sleep(0.05)
    return store


def wait_for_every_rank(group: TensorParallelGroup) -> None:
    """Meet the other ranks once each has loaded its shard; fails naming a rank that never came."""
    dist.monitored_barrier(group=group.control_group, timeout=_STARTUP_TIMEOUT)


def destroy_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
