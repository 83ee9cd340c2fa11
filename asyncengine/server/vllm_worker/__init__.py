"""SMG's vLLM worker protocol (`vllm.grpc.engine.VllmEngine`, from PyPI smg-grpc-proto) served
beside asyncengine.v1 on the same gRPC port, so the Shepherd Model Gateway routes to this
engine as it does to vLLM workers."""
