"""What the model fingerprint costs at load: hashing every weight byte and the tokenizer.

    python -m benchmarks.micro.fingerprint [--repeats 5] [--out benchmarks/results/fingerprint.json]

The default model (fp32 on the CPU). Medians over repeats (one warm-up excluded) of: the weight
hash (all tensor bytes, xxh3-128, parallel threads), the tokenizer hash, the whole fingerprint,
and building an Engine (which computes it), with the weight bytes hashed and GB/s.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvboost_engine import Engine
from kvboost_engine.model.fingerprint import model_fingerprint, tokenizer_digest, weights_digest

from .._common import environment, load_default, median_time



def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "results" / "fingerprint.json"))
    args = parser.parse_args(argv)
    model, tokenizer = load_default()
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}
    weight_bytes = sum(unique.values())
    rope = {}
    weights = median_time(lambda: weights_digest(model), args.repeats)
    result = {
        "weight_bytes": weight_bytes,
        "weights_s": round(weights, 4), "weights_GB_s": round(weight_bytes / weights / 1e9, 2),
        "tokenizer_s": round(median_time(lambda: tokenizer_digest(tokenizer), args.repeats), 4),
        "fingerprint_s": round(median_time(lambda: model_fingerprint(model, rope, tokenizer), args.repeats), 4),
        "engine_build_s": round(median_time(lambda: Engine(model, tokenizer), args.repeats), 4),
    }
    record = {"settings": vars(args), "environment": environment(model), **result}
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
