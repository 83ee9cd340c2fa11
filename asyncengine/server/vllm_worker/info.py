"""What a gateway reads about this worker (model, server, load), one builder per fact for both
front ends: the gRPC worker service answers with these messages, and the HTTP API with the same
fields as JSON (/get_model_info, /get_server_info, /get_load) for HTTP-mode routers."""

from __future__ import annotations

import time
import weakref
from datetime import datetime, timezone
from typing import Any

from google.protobuf.json_format import MessageToDict
from smg_grpc_proto import vllm_engine_pb2 as pb

import asyncengine
from asyncengine.server.state import ServerState
from asyncengine.server.vllm_worker import convert
from asyncengine.server.vllm_worker.tokenizer_zip import TokenizerZip

_TOKENIZERS: weakref.WeakKeyDictionary[ServerState, TokenizerZip] = weakref.WeakKeyDictionary()


def tokenizer_zip(state: ServerState) -> TokenizerZip:
    """The server's one tokenizer bundle (and, with --chat-template, its one directory)."""
    made = _TOKENIZERS.get(state)
    if made is None:
        config = state.engine.config.model_config
        made = _TOKENIZERS[state] = TokenizerZip(config.tokenizer, state.options.chat_template)
    return made


def model_info(state: ServerState) -> pb.GetModelInfoResponse:
    engine = state.engine
    model = engine.config.model_config
    tokenizer = engine.get_tokenizer()
    bos, pad = tokenizer.bos_token_id, tokenizer.pad_token_id
    return pb.GetModelInfoResponse(
        model_path=model.model,
        is_generation=True,
        max_context_length=model.max_model_len,
        vocab_size=engine.vocab_size,
        supports_vision=False,
        served_model_name=state.model_name,
        # where a gateway on this host reads the tokenizer; one elsewhere takes GetTokenizer
        tokenizer_path=tokenizer_zip(state).local_dir(),
        model_type=getattr(model.hf_config, "model_type", "") or "",
        architectures=list(getattr(model.hf_config, "architectures", None) or []),
        eos_token_ids=list(engine.eos_token_ids),
        pad_token_id=pad if isinstance(pad, int) else 0,
        bos_token_id=bos if isinstance(bos, int) else 0,
        # a prompt leaves room for at least one generated token
        max_req_input_len=model.max_model_len - 1,
    )


def server_info(state: ServerState) -> pb.GetServerInfoResponse:
    config = state.engine.config
    return pb.GetServerInfoResponse(
        active_requests=state.num_admitted,
        is_paused=state.is_draining,
        last_receive_timestamp=time.time(),
        uptime_seconds=time.monotonic() - state.started_at,
        server_type="vllm-grpc",
        data_parallel_size=1,
        kv_cache_dtype="auto",
        block_size=config.cache_config.block_size,
        model_dtype=config.model_config.dtype,
        max_num_seqs=config.scheduler_config.max_num_seqs,
    )


def loads(state: ServerState) -> pb.GetLoadsResponse:
    return pb.GetLoadsResponse(
        timestamp=datetime.now(timezone.utc).isoformat(),
        version=asyncengine.__version__,
        dp_rank_count=1,
        loads=[convert.scheduler_load(state.engine.get_load())],
    )


def as_json(message: Any) -> dict[str, Any]:
    """A message as the HTTP side answers it: proto field names, zeros included."""
    return dict(
        MessageToDict(
            message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
    )
