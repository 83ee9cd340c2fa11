"""The driver of tensor parallelism: stands where `ModelRunner` stands in `LLMEngine`.

Rank 0 is the engine process. It starts ranks 1..N-1 of its node (spawned without the user's
`__main__`, `processes.py`; ranks on other nodes come from `asyncengine worker`), runs its own
`ModelRunner` over its shard, and tells the workers each step's block moves and forward inputs
just before its own forward (`channel.py`), then asks them into each logits gather. Sampling,
the scheduler and every request's state stay here, on rank 0.

Failures are engine-fatal and bounded: a worker that exits is seen at once (its process
sentinel; gloo also fails the collective in flight), one that hangs fails the driver's next
collective after `distributed_timeout_s`. Either way every worker is stopped, and the step
raises `TensorParallelError`, so the engine dies cleanly instead of hanging.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import socket
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from asyncengine.config import EngineConfig
from asyncengine.core.scheduler import SchedulerOutput
from asyncengine.distributed.channel import ControlChannel, Kind
from asyncengine.distributed.parallel_state import (
    destroy_tensor_parallel,
    init_tensor_parallel,
    wait_for_every_rank,
)
from asyncengine.distributed.worker import rank_config, report_num_blocks, start_workers
from asyncengine.logging import get_logger
from asyncengine.worker.forward_context import get_forward_context
from asyncengine.worker.model_runner import ModelRunner, ModelRunnerOutput
from asyncengine.worker.sampler import Grammars

logger = get_logger(__name__)

# how long shutdown waits for a step in flight, then for the workers to exit on their own
_SHUTDOWN_GRACE_S = 5.0


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died, hung past the timeout, or a collective failed."""


def free_init_method() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


class TensorParallelExecutor:
    """`determine_num_blocks`, `initialize_cache`, `execute_model` over N ranks, plus
    `check_health` and `shutdown`. One engine per process: torch.distributed has one world."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        parallel = config.parallel_config
        device = config.device_config.device
        if dist.is_initialized():  # torch.distributed has one default group per process
            raise RuntimeError(
                "a tensor-parallel engine already runs in this process: shut it down first "
                "(LLM.shutdown(), await AsyncLLMEngine.shutdown())"
            )
        init_method = parallel.distributed_init_method or free_init_method()
        self._lock = threading.Lock()  # one user of the collectives at a time
        self._failure: TensorParallelError | None = None
        self._is_closed = False
        self._pending_moves: SchedulerOutput | None = None
        self.workers = start_workers(config, range(1, parallel.ranks_per_node), init_method)
        # at exit or when the engine is dropped, no worker outlives it
        self._finalizer = weakref.finalize(self, _stop_processes, list(self.workers))
        try:
            self.tp = init_tensor_parallel(
                parallel, 0, init_method, device, self._check_started_workers
            )
            self.runner = ModelRunner(rank_config(config), self.tp)
            wait_for_every_rank(self.tp)
        except BaseException:
            self.shutdown()
            raise
        self.channel = ControlChannel(self.tp, device, self.runner.dtype)
        self._watcher = threading.Thread(
            target=self._watch_workers, name="asyncengine-tp-watch", daemon=True
        )
        self._watcher.start()
        logger.info(
            "tensor_parallel_started",
            tensor_parallel_size=parallel.tensor_parallel_size,
            num_nodes=parallel.num_nodes,
            backend="nccl" if device == "cuda" else "gloo",
            worker_pids=self.worker_pids,
        )

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.workers if p.pid is not None]

    # -- the three calls LLMEngine makes ---------------------------------------------------------

    def determine_num_blocks(self) -> tuple[int, int]:
        """Each rank sizes its cache; the smallest counts are every rank's (the same block ids)."""
        with self._collectives():
            self.channel.send(Kind.SIZE_CACHE)
            return report_num_blocks(self.runner, self.tp)

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        with self._collectives():
            self.channel.send(Kind.INITIALIZE_CACHE, (num_gpu_blocks, num_cpu_blocks))
            self.runner.initialize_cache(num_gpu_blocks, num_cpu_blocks)
        # from now on each forward and logits call of the runner is announced to the workers
        self.runner.model = _DriverModel(self.runner.model, self)

    def execute_model(
        self, plan: SchedulerOutput, grammars: Grammars | None = None
    ) -> ModelRunnerOutput:
        with self._collectives():
            has_moves = plan.blocks_to_swap_out or plan.blocks_to_swap_in or plan.blocks_to_copy
            self._pending_moves = plan if has_moves else None
            for slot, weights in plan.lora_loads.items():
                self.channel.send_lora(slot, weights)
            try:
                output = self.runner.execute_model(plan, grammars)
                if self._pending_moves is not None:  # no forward ran to carry them
                    self.channel.send_moves(self._pending_moves)
            finally:
                self._pending_moves = None
            return output

    def send_forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Called by the driver's model as its forward starts: the workers run theirs."""
        moves, self._pending_moves = self._pending_moves, None
        context = get_forward_context()
        segments = context.lora.segments if context.lora is not None else []
        self.channel.send_step(moves, input_ids, positions, context.attn_metadata, segments)

    # -- health and shutdown ---------------------------------------------------------------------

    def check_health(self) -> None:
        """Raise `TensorParallelError` once any rank has failed."""
        if self._failure is not None:
            raise self._failure

    def shutdown(self) -> None:
        """Stop every worker (asking first, when they are well) and leave the process group."""
        if self._is_closed:
            return
        self._is_closed = True
        is_idle = self._lock.acquire(timeout=_SHUTDOWN_GRACE_S)
        try:
            if is_idle and self._failure is None and hasattr(self, "channel"):
                try:
                    self.channel.send(Kind.SHUTDOWN)
                    for process in self.workers:
                        process.join(_SHUTDOWN_GRACE_S)
                except Exception as exc:  # a worker already gone: stopped below
                    logger.warning("tp_shutdown_message_failed", cause=repr(exc))
            _stop_processes(self.workers)
            # a step still in flight fails fast now that its peers are gone
            if is_idle or self._lock.acquire(timeout=_SHUTDOWN_GRACE_S):
                is_idle = True
                destroy_tensor_parallel()
        finally:
            if is_idle:
                self._lock.release()
        logger.info("tensor_parallel_stopped", worker_exit_codes=self._exit_codes())

    def _check_started_workers(self) -> None:
        for process in self.workers:
            if process.exitcode is not None:
                raise TensorParallelError(
                    f"{process.name} exited with code {process.exitcode} while starting "
                    "(its log says why)"
                )

    @contextlib.contextmanager
    def _collectives(self) -> Iterator[None]:
        """Hold the lock around the driver's collectives. Any error in them is engine-fatal:
        the ranks may be out of step, so none of them may run another collective."""
        self.check_health()
        if self._is_closed:
            raise TensorParallelError("the tensor-parallel executor was shut down")
        with self._lock:
            try:
                yield
            except BaseException as exc:
                failure = self.fail(exc)
                _leave_process_group(self.config.device_config.device)
                # a bad config (ValueError) and Ctrl-C reach the caller as they are
                if isinstance(exc, Exception) and not isinstance(exc, ValueError):
                    raise failure from exc
                raise

    def fail(self, cause: BaseException) -> TensorParallelError:
        """Record the first failure and stop every worker: the engine cannot step any more."""
        if self._failure is None:
            error = TensorParallelError(f"tensor parallelism failed: {cause}")
            error.__cause__ = cause
            self._failure = error
            logger.error("tensor_parallel_failed", cause=repr(cause), exit_codes=self._exit_codes())
        _stop_processes(self.workers, grace_s=0.0)  # a hung (even SIGSTOPped) one included
        return self._failure

    def _watch_workers(self) -> None:
        sentinels = {p.sentinel: p for p in self.workers}
        while sentinels and not self._is_closed:
            for ready in multiprocessing.connection.wait(list(sentinels), timeout=1.0):
                process = sentinels.pop(ready)
                if self._is_closed:
                    return
                process.join()
                self.fail(RuntimeError(f"{process.name} exited with code {process.exitcode}"))
                if self.config.device_config.device == "cuda":
                    _abort_collectives()  # NCCL waits out its timeout for a dead peer otherwise
                return

    def _exit_codes(self) -> dict[str, int | None]:
        return {p.name: p.exitcode for p in self.workers}


class _DriverModel:
    """The driver's model: announces each forward and logits call to the workers first.
    Anything else is the model's own (`driver_model.model.layers` as for the model)."""

    def __init__(self, model: Any, executor: TensorParallelExecutor) -> None:
        self._model = model
        self._executor = executor

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self._executor.send_forward(input_ids, positions)
        return self._model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self._executor.channel.send_logits(hidden)
        return self._model.compute_logits(hidden)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def _stop_processes(processes: list[Any], grace_s: float = _SHUTDOWN_GRACE_S) -> None:
    """SIGTERM, then SIGKILL for any still alive after `grace_s` (at once when 0)."""
    for process in processes:
        if process.is_alive():
            process.terminate() if grace_s else process.kill()
    for process in processes:
        process.join(grace_s)
        if process.is_alive():
            process.kill()
            process.join()


def _leave_process_group(device: str) -> None:
    """After a failure: a later engine in this process may start its own process group."""
    try:
        if device == "cuda":
            _abort_collectives()
        destroy_tensor_parallel()
    except Exception as exc:
        logger.warning("tp_process_group_not_destroyed", cause=repr(exc))


def _abort_collectives() -> None:
    try:
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()
    except Exception as exc:  # best effort: the collective's own timeout still holds
        logger.warning("tp_abort_failed", cause=repr(exc))
