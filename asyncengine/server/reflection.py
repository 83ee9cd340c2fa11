"""gRPC server reflection under both names: `grpc.reflection.v1` (newer grpcurl and gateways try
it first) and `grpc.reflection.v1alpha` (older tools)."""

import grpc
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as pb

V1ALPHA_SERVICE_NAME: str = reflection.SERVICE_NAME
V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"


def enable_reflection(service_names: tuple[str, ...], server: grpc.aio.Server) -> None:
    """Serve reflection of `service_names` (and of both reflection services) on `server`."""
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    # grpcio-reflection 1.85 ships only v1alpha; v1's messages are v1alpha's with the package
    # renamed (same fields, same numbers), so the same servicer answers v1 on the wire unchanged
    servicer = reflection.aio.ReflectionServicer(names)
    handlers = {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=pb.ServerReflectionRequest.FromString,
            response_serializer=pb.ServerReflectionResponse.SerializeToString,
        )
    }
    v1 = grpc.method_handlers_generic_handler(V1_SERVICE_NAME, handlers)
    server.add_generic_rpc_handlers((v1,))
