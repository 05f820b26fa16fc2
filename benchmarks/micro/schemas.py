"""Schema conformance and constrained decode speed on the default model (issue 18).

Conformance: N generated schemas (benchmarks/micro/schemagen.py), one greedy request each under
`JsonSchema(schema)`. Every output that ends with finish_reason "stop" must parse and validate
with `jsonschema` (Draft 2020-12); outputs cut by max_new_tokens (finish_reason "length") are
counted separately; anything else (invalid JSON, a validation error, a compile error) is a failure.

Speed: on the first K schemas (K may exceed N: --schemas 0 measures speed alone), decode tokens/s
constrained vs unconstrained on the same prompt and the same number of tokens (the unconstrained
run gets min_new_tokens = max_new_tokens = the constrained run's count), runs interleaved C, U, U, C, ...; decode excludes time to first token.

Run: python -m benchmarks.micro.schemas [--schemas 200 --speed-schemas 20 --repeats 2
     --max-new-tokens 256 --threads 1 --out benchmarks/results/schemas.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jsonschema
import torch

from kvboost_engine import Engine, InputError
from kvboost_engine.constrained import JsonSchema

from .._common import environment, load_default
from .schemagen import SchemaGen, features


def prompt_for(schema: dict) -> list[dict]:
    return [{"role": "system", "content": "You write realistic example records as JSON."},
            {"role": "user", "content": f"Write one example {schema['title']} record following this JSON schema:\n"
                                        + json.dumps(schema)}]


def check(schema: dict, engine: Engine, max_new_tokens: int) -> dict:
    """One constrained request: its outcome ("valid", "length", "invalid", "compile_error") and figures."""
    record = {"title": schema["title"]}
    started = time.perf_counter()
    try:
        gen = engine.chat(prompt_for(schema), constraint=JsonSchema(schema), max_new_tokens=max_new_tokens)
    except InputError as err:
        return {**record, "outcome": "compile_error", "error": str(err)[:300]}
    record.update(tokens=gen.completion_tokens, finish_reason=gen.finish_reason, seconds=time.perf_counter() - started)
    if gen.finish_reason == "length":
        return {**record, "outcome": "length", "tail": gen.text[-60:]}
    try:
        jsonschema.Draft202012Validator(schema).validate(json.loads(gen.text))
    except (json.JSONDecodeError, jsonschema.ValidationError) as err:
        return {**record, "outcome": "invalid", "error": str(err)[:300], "text": gen.text}
    return {**record, "outcome": "valid"}


def decode_rate(gen) -> float:
    """Decode tokens/s: tokens after the first, over the time after the first."""
    return (gen.completion_tokens - 1) / max(gen.total_s - gen.ttft_s, 1e-9)


def speed_pair(schema: dict, engine: Engine, max_new_tokens: int, repeats: int) -> dict | None:
    """Median decode tokens/s constrained and unconstrained, same prompt, same token count."""
    messages = prompt_for(schema)
    first = engine.chat(messages, constraint=JsonSchema(schema), max_new_tokens=max_new_tokens)   # warm-up
    n = first.completion_tokens
    if n < 8:
        return None
    constrained, free = [], []
    for repeat in range(repeats):
        order = ("c", "u") if repeat % 2 == 0 else ("u", "c")
        for mode in order:
            if mode == "c":
                constrained.append(decode_rate(engine.chat(messages, constraint=JsonSchema(schema), max_new_tokens=n)))
            else:
                free.append(decode_rate(engine.chat(messages, max_new_tokens=n, min_new_tokens=n)))
    c, u = statistics.median(constrained), statistics.median(free)
    return {"title": schema["title"], "tokens": n, "constrained_tok_s": c, "unconstrained_tok_s": u, "ratio": c / u}


def summarize(records: list[dict], speed: list[dict]) -> dict:
    outcomes = {k: sum(r["outcome"] == k for r in records) for k in ("valid", "length", "invalid", "compile_error")}
    ratios = [p["ratio"] for p in speed]
    return {"schemas": len(records), **outcomes,
            "valid_share_of_finished": outcomes["valid"] / max(1, len(records) - outcomes["length"]),
            "median_tokens": statistics.median([r["tokens"] for r in records if "tokens" in r] or [0]),
            "speed_pairs": len(ratios),
            "speed_ratio_median": statistics.median(ratios) if ratios else None,
            "speed_ratio_min": min(ratios) if ratios else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schemas", type=int, default=200)
    parser.add_argument("--speed-schemas", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="benchmarks/results/schemas.json")
    parser.add_argument("--deadline-min", type=float, default=None,
                        help="check no new schema after this many minutes (the summary counts those checked)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_default()
    engine = Engine(model, tokenizer, cache_bytes=256 * 2**20, model_name="SmolLM2-135M-Instruct")
    generator = SchemaGen(args.seed)
    schemas = [generator.schema(i) for i in range(max(args.schemas, args.speed_schemas))]
    covered = sorted(set().union(*(features(s) for s in schemas[:args.schemas])))
    records, started = [], time.monotonic()
    for schema in schemas[:args.schemas]:
        if args.deadline_min is not None and time.monotonic() - started > args.deadline_min * 60:
            print(f"deadline reached after {len(records)} schemas", flush=True)
            break
        records.append(check(schema, engine, args.max_new_tokens))
        print(json.dumps({k: v for k, v in records[-1].items() if k in ("title", "outcome", "tokens")}), flush=True)
    speed = [p for s in schemas[:args.speed_schemas]
             if (p := speed_pair(s, engine, args.max_new_tokens, args.repeats)) is not None]
    for pair in speed:
        print(json.dumps(pair), flush=True)
    result = {"environment": environment(model), "settings": vars(args), "features": covered,
              "summary": summarize(records, speed), "records": records, "speed": speed}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
