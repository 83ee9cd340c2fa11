"""The gRPC floor: a bare grpc.aio Generation servicer that runs no engine at all.

Each GenerateStream call gets what asyncengine's server sends for a 64-token request:
Accepted, `--deltas` Delta messages carrying the tokens, Finished and Usage. Nothing is
validated, admitted, scheduled or logged, so a closed loop against it measures what grpc.aio
and protobuf alone cost per request on this machine, server and client together: no server
written in Python with grpc.aio delivers more requests per second with that many messages.

    python benchmarks/grpc_floor.py --port 50100 --deltas 12      # serve until killed

benchmarks/serving.py --floor starts it and runs its client against it.
"""

from __future__ import annotations

import argparse
from typing import Any

import grpc

from asyncengine.v1 import generation_pb2 as pb
from asyncengine.v1 import generation_pb2_grpc


class FloorServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, num_deltas: int) -> None:
        self.num_deltas = max(1, num_deltas)

    async def GenerateStream(self, request: pb.GenerateRequest, context: Any) -> None:
        max_tokens = request.stopping.max_new_tokens or 16
        num_prompt = len(request.token_ids.ids)
        await context.write(
            pb.GenerateResponse(accepted=pb.Accepted(request_id="floor", prompt_tokens=num_prompt))
        )
        sent = 0
        for i in range(self.num_deltas):
            upto = max_tokens * (i + 1) // self.num_deltas
            ids = list(range(sent, upto))
            delta = pb.Delta(
                sequence_number=i + 1,
                token_offset=sent,
                text="ab" * len(ids),
                completion_tokens=upto,
            )
            sent = upto
            await context.write(pb.GenerateResponse(delta=delta))
        await context.write(pb.GenerateResponse(finished=pb.Finished(reason=pb.LENGTH)))
        usage = pb.Usage(prompt_tokens=num_prompt, completion_tokens=max_tokens)
        await context.write(pb.GenerateResponse(usage=usage))


async def serve(port: int, num_deltas: int) -> None:
    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServicer_to_server(FloorServicer(num_deltas), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("serving", flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--deltas", type=int, default=12, help="Delta messages per request")
    ns = parser.parse_args()
    import uvloop  # as `asyncengine serve` runs

    uvloop.run(serve(ns.port, ns.deltas))


if __name__ == "__main__":
    main()
