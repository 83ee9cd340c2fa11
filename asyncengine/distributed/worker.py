"""A tensor-parallel worker process: its shard of the model and KV cache, run as the driver says.

Ranks 1..N-1 run `worker_main` (started by the driver with `processes.start_process`, or
by `asyncengine worker` on another node). A worker holds no request state: it applies each
step's block moves, runs the forward over its heads, and joins the logits gather; the driver
samples. It ends on the driver's SHUTDOWN, when the driver's connection closes, when its
parent process is gone, or on any error of its own (exit code 1: the driver then fails too).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from asyncengine.config import EngineConfig
from asyncengine.distributed.channel import ControlChannel, Kind
from asyncengine.distributed.parallel_state import (
    TensorParallelGroup,
    destroy_tensor_parallel,
    init_tensor_parallel,
    wait_for_every_rank,
)
from asyncengine.logging import configure_logging, get_logger
from asyncengine.processes import start_process
from asyncengine.worker.forward_context import set_forward_context
from asyncengine.worker.model_runner import ModelRunner

logger = get_logger(__name__)

_PARENT_POLL_S = 1.0


def rank_config(config: EngineConfig) -> EngineConfig:
    """The config each rank sizes its cache by: CPU ranks share one host's memory."""
    if config.device_config.device != "cpu":
        return config
    cache = config.cache_config
    share = cache.gpu_memory_utilization / config.parallel_config.ranks_per_node
    return dataclasses.replace(
        config, cache_config=dataclasses.replace(cache, gpu_memory_utilization=share)
    )


def start_workers(config: EngineConfig, ranks: range, init_method: str) -> list[Any]:
    """Start ranks `ranks` of this node as spawned processes (daemons: they die with us) that
    do not re-run the user's `__main__`, so a script needs no main guard (`processes.py`)."""
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    settings = {"num_threads": torch.get_num_threads(), "log_level": level}
    per_node = config.parallel_config.ranks_per_node
    return [
        start_process(
            worker_main,
            (rank, rank % per_node, rank_config(config), init_method, os.getpid(), settings),
            name=f"asyncengine-tp-rank-{rank}",
            daemon=True,
        )
        for rank in ranks
    ]


def run_node(config: EngineConfig, node_rank: int) -> int:
    """`asyncengine worker`: run node `node_rank`'s ranks until they end; the exit code.

    Ends with the first rank that exits: 0 when the driver shut them down, 1 (stopping the
    rest) when one failed. SIGTERM or SIGINT stops them all.
    """
    parallel = config.parallel_config
    if not 1 <= node_rank < parallel.num_nodes:
        raise ValueError(f"--node-rank must be in [1, {parallel.num_nodes - 1}], got {node_rank}")
    if parallel.distributed_init_method is None:
        raise ValueError("--distributed-init-method tcp://LEADER:PORT is needed on every node")
    per_node = parallel.ranks_per_node
    ranks = range(node_rank * per_node, (node_rank + 1) * per_node)
    processes = start_workers(config, ranks, parallel.distributed_init_method)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    logger.info("tp_node_started", node_rank=node_rank, ranks=list(ranks))
    alive = {p.sentinel: p for p in processes}
    exit_code = 0
    while alive and not stop.is_set():
        for ready in multiprocessing.connection.wait(list(alive), timeout=0.5):
            process = alive.pop(ready)
            process.join()
            if process.exitcode != 0:
                logger.error("tp_rank_failed", rank=process.name, exit_code=process.exitcode)
                exit_code = 1
                stop.set()
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join()
    return exit_code


def worker_main(
    rank: int,
    local_rank: int,
    config: EngineConfig,
    init_method: str,
    parent_pid: int | None,
    settings: dict[str, Any],
) -> None:
    """The whole life of rank `rank` (>= 1); `parent_pid`: exit when that process is gone.
    `settings`: the driver's torch thread count and log level."""
    # Ctrl-C in a terminal signals the whole process group: the driver decides when we stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent_pid is not None:
        _exit_with_parent(parent_pid)
    configure_logging(settings["log_level"])
    torch.set_num_threads(settings["num_threads"])
    device = config.device_config.device
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    logger.info("tp_worker_started", rank=rank, pid=os.getpid(), device=device)
    try:
        tp = init_tensor_parallel(config.parallel_config, rank, init_method, device)
        runner = ModelRunner(config, tp)
        wait_for_every_rank(tp)
        _serve(runner, tp)
    except Exception as exc:
        # the driver sees the broken connection; the cause is told here, in this rank's log
        logger.error("tp_worker_failed", rank=rank, cause=repr(exc), exc_info=exc)
        sys.stderr.flush()
        os._exit(1)
    destroy_tensor_parallel()
    logger.info("tp_worker_stopped", rank=rank)
    # nothing here needs Python's slow teardown (seconds with torch loaded): leave at once
    sys.stderr.flush()
    os._exit(0)


@torch.inference_mode()
def _serve(runner: ModelRunner, tp: TensorParallelGroup) -> None:
    channel = ControlChannel(tp, runner.device, runner.dtype)
    while True:
        message = channel.recv()
        if message.kind is Kind.SHUTDOWN:
            return
        if message.kind is Kind.SIZE_CACHE:
            report_num_blocks(runner, tp)
        elif message.kind is Kind.INITIALIZE_CACHE:
            runner.initialize_cache(*message.args)
        elif message.kind in (Kind.STEP, Kind.MOVES):
            step = channel.recv_step(message)
            assert runner.cache_engine is not None
            runner.cache_engine.apply(step.moves)
            if step.attn_metadata is not None:
                assert step.input_ids is not None
                lora = runner.lora_batch(step.lora_segments, len(step.input_ids))
                cache = runner.cache_engine.gpu_cache
                with set_forward_context(step.attn_metadata, cache, lora):
                    runner.model(step.input_ids, step.positions)
        elif message.kind is Kind.LOAD_LORA:
            runner.load_loras(dict([channel.recv_lora(message)]))
        elif message.kind is Kind.LOGITS:
            runner.model.compute_logits(channel.recv_hidden(message))


def report_num_blocks(runner: Any, tp: TensorParallelGroup) -> tuple[int, int]:
    """Every rank's (device, swap) block counts, reduced to the smallest: each rank holds
    the same block ids. A rank that cannot size its cache reports -1, failing them all."""
    try:
        counts, error = list(runner.determine_num_blocks()), None
    except Exception as exc:
        counts, error = [-1, -1], exc
    shape = _fingerprint(runner.config)
    reduced = torch.tensor([*counts, shape, -shape], dtype=torch.long)
    dist.all_reduce(reduced, op=dist.ReduceOp.MIN, group=tp.control_group)
    if error is not None:
        raise error
    if int(reduced[2]) != -int(reduced[3]):
        raise RuntimeError(
            "the tensor-parallel ranks were started with different engine flags (model, dtype, "
            "block size): give every node the same ones"
        )
    if int(reduced[:2].min()) < 0:
        raise RuntimeError("a tensor-parallel rank could not size its KV cache (its log says why)")
    return int(reduced[0]), int(reduced[1])


def _fingerprint(config: EngineConfig) -> int:
    """What every rank must agree on, as one number (equal on all ranks, or they differ)."""
    model, cache = config.model_config, config.cache_config
    hf_config = model.hf_config
    key = (model.architecture, model.dtype, model.max_model_len, cache.block_size,
           int(hf_config.num_hidden_layers), int(hf_config.hidden_size))  # fmt: skip
    return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:7], "big")


def _exit_with_parent(parent_pid: int) -> None:
    """A watchdog thread: a worker whose driver was SIGKILLed must not outlive it."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="asyncengine-tp-parent-watch", daemon=True).start()
