"""gRPC's standard health service over the server core's readiness: readiness ("" and each
service's name) follows admission (a drain turns it NOT_SERVING, Resume back); liveness stays
SERVING from start until shutdown. HTTP's /health reads the core itself."""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2

from asyncengine.server.state import LIVENESS_SERVICE
from asyncengine.server.vllm_worker.servicer import SERVICE_NAME as VLLM_WORKER_SERVICE
from asyncengine.v1 import control_pb2, generation_pb2

SERVICE_NAMES = (
    generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
    control_pb2.DESCRIPTOR.services_by_name["Control"].full_name,
    VLLM_WORKER_SERVICE,
)
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class GrpcHealth:
    """The health servicer and the statuses it reports; a readiness listener of the core."""

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()

    async def set_ready(self, is_ready: bool) -> None:
        """Readiness ("") and each service's health; the liveness entry is not touched."""
        status = _SERVING if is_ready else _NOT_SERVING
        for name in ("", *SERVICE_NAMES):
            await self.servicer.set(name, status)

    async def set_live(self) -> None:
        await self.servicer.set(LIVENESS_SERVICE, _SERVING)

    async def shut_down(self) -> None:
        """Every entry NOT_SERVING, for good (watchers are told)."""
        await self.servicer.enter_graceful_shutdown()
