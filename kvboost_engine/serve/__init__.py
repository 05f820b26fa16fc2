"""One engine behind an OpenAI-compatible HTTP API, for several processes sharing one engine and
its KV cache: `python -m kvboost_engine.serve --model ...` (see `--help`), or in code:

    from kvboost_engine.serve import Server, create_app
    with Server(create_app(engine, api_key="secret")) as server:
        OpenAI(base_url=server.url, api_key="secret").chat.completions.create(...)

The server is a caller of the engine (the engine never imports it). It needs the `serve` extra
(starlette, uvicorn).
"""
from .app import ServerState, create_app
from .server import Server

__all__ = ["create_app", "Server", "ServerState"]
