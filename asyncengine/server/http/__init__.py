"""The OpenAI-compatible HTTP front end (FastAPI + uvicorn): it translates only, over the same
engine, admission, tokens, drain and metrics as gRPC (`asyncengine serve --http-port`)."""

from asyncengine.server.http.server import HttpServer

__all__ = ["HttpServer"]
