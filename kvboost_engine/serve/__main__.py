"""`python -m kvboost_engine.serve`: load one engine and serve it over OpenAI's HTTP API.

    python -m kvboost_engine.serve                         # the default model on 127.0.0.1:8000
    python -m kvboost_engine.serve --model ./my-model --port 8001 --api-key secret --max-running 8

The API key may also come from KVBOOST_API_KEY. SIGTERM (or Ctrl-C) drains: no new connections, idle
ones closed (a request reaching the app meanwhile gets 503), those in flight finish (up to
--drain-timeout-s), then the process exits.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

_UNITS = {"": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30}


def byte_size(text: str) -> int:
    """'512MiB', '2GiB', '1048576' -> bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"a byte size such as 512MiB or 2GiB, got {text!r}")
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def port_number(text: str) -> int:
    if not text.strip().isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"a port number 0-65535, got {text!r}")
    return int(text)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvboost_engine.serve",
                                description="Serve one engine over OpenAI's HTTP API.")
    p.add_argument("--model", default=None, help="as Engine.from_pretrained: a named model, an HF directory, a "
                   ".gguf file or a hub id (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 exposes it "
                   "to the network)")
    p.add_argument("--port", type=port_number, default=8000, help="default 8000 (0: a free one)")
    p.add_argument("--api-key", default=os.environ.get("KVBOOST_API_KEY"),
                   help="require Authorization: Bearer <key> on /v1/* and /tokenize (default: $KVBOOST_API_KEY; unset: open)")
    p.add_argument("--max-running", type=int, default=None, help="requests batched together (engine default 16)")
    p.add_argument("--max-waiting", type=int, default=None, help="requests queued beyond the free slots before 429")
    p.add_argument("--queue-timeout-s", type=float, default=None, help="longest wait for a running slot")
    p.add_argument("--cache-bytes", type=byte_size, default=None, help="KV cache budget, e.g. 2GiB")
    p.add_argument("--kv-pool-bytes", type=byte_size, default=None, help="RAM for all KV, cached and running")
    p.add_argument("--weights", default=None, help="CPU weight format: fp32, bf16, int8, int4")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-body-bytes", type=byte_size, default=None, help="largest request body, 413 past it "
                   "(default 8MiB)")
    p.add_argument("--drain-timeout-s", type=float, default=30,
                   help="on SIGTERM, longest wait for in-flight requests (default 30)")
    p.add_argument("--log-level", default="info", help="uvicorn's (default info)")
    return p


def engine_options(args: argparse.Namespace) -> dict:
    """The Engine.from_pretrained options given on the command line (the others keep their defaults)."""
    names = ("max_running", "max_waiting", "queue_timeout_s", "cache_bytes", "kv_pool_bytes", "weights", "device",
             "dtype")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from .server import Server, listen_socket

    try:                                    # the address first: a busy port is told at once, not after the load
        sock = listen_socket(args.host, args.port)
    except (OSError, OverflowError) as err:
        return _fail(f"cannot listen on {args.host}:{args.port}: {err}")
    from ..engine import Engine
    from ..errors import KVBoostError
    from .app import MAX_BODY_BYTES, create_app
    try:
        engine = Engine.from_pretrained(args.model, **engine_options(args))
    except (KVBoostError, ValueError, OSError) as err:     # a model not found or unreadable, a bad option
        sock.close()
        return _fail(str(err))
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.model)) if args.model else None)
    app = create_app(engine, model_name=name, api_key=args.api_key,
                     max_body_bytes=args.max_body_bytes or MAX_BODY_BYTES)
    server = Server(app, drain_timeout_s=args.drain_timeout_s, log_level=args.log_level, sock=sock)
    print(f"kvboost: serving {app.state.kvboost.model_name} on {server.url}"
          f"{' (API key required)' if args.api_key else ''}", file=sys.stderr, flush=True)
    try:
        server.serve()
    finally:
        engine.close()
    return 0


def _fail(message: str) -> int:
    print(f"kvboost: {message}", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
