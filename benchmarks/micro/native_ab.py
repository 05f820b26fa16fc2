"""Two versions of the native step in one process, paired (#29): the package's native/decode.cpp (A)
against another copy of it (B: a file, or the copy at a git revision), both built for one variant and
run over the same model, KV and tokens, round after round in alternating order (A then B, then B
then A), so the machine's drift (on these 2-core VMs up to 25 % within minutes) falls on both alike.
The tool for a kernel change: a probe switched by an environment variable inside decode.cpp was the
way before, and had to be written and taken out again for every change.

Cases, each timed over --steps calls a round:
  shared M     one decode step of M rows over one sequence's KV at its end (--context keys; as
               sequences over one cached system prompt; one token, as they share its slot), for each
               M in --rows
  unshared M   M rows each over its own copy of that KV (M <= 16)
  paged M      M sequences of the engine's block pool, as the engine runs chats over one cached system
               prompt: the pool blocks of the first P positions shared (P: --context rounded down to
               a whole block), then OWN_TOKENS tokens of each one's own, and one new token each in its
               own slot (M <= 16)
  prefill N    N tokens prefilled natively into a fresh KV (--prefill; 0: none); with float32 weights on
               an Intel CPU the engine runs prompt chunks on PyTorch's MKL products instead
               (decoder.float_prefill_off): the case is then named "(not the engine's path here)" and
               engine_prefill gives the reason
Per case: A's and B's median ms, the median of the rounds' B / A time ratios (below 1: B faster) and
their range, and whether A's and B's outputs (logits) are the same bit for bit (a refactor should
keep them; a change of arithmetic will not).

Run alone on a quiet machine (about 3 minutes for the defaults on 2 cores, plus building B: about a minute):
  python -m benchmarks.micro.native_ab --against HEAD [--weights int4] [--context 1000] [--rows 1,8]
      [--prefill 512] [--rounds 10] [--steps 40] [--isa avx2] [--out benchmarks/results/native_ab.json]
  python -m benchmarks.micro.native_ab --against /tmp/decode_variant.cpp
At a real size, a GGUF file as stored (--gguf; --weights is then ignored), e.g. the random-weight
SmolLM2-1.7B shape that benchmarks/gguf_models.py writes (its 8 unshared KV copies at 1,000 tokens
take ~3 GB of float32; fewer steps, the steps being ~10x longer):
  python -m benchmarks.micro.native_ab --against FILE --gguf <smollm2-1.7b-random.Q4_0.gguf> --steps 8
Smoke: python -m benchmarks.micro.native_ab --against HEAD --smoke
A note, not a README figure source: a kernel change that gains here is then measured with the
modules whose figures the README gives (native_steps, batching).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvboost_engine.config import EngineConfig
from kvboost_engine.kv.contiguous import SequenceKV
from kvboost_engine.kv.paged import PagedSequence
from kvboost_engine.kv.pool import BlockPool
from kvboost_engine.model.arch import ModelAdapter
from kvboost_engine.native import build
from kvboost_engine.native.decoder import NativeDecoder, unsupported_reason

from .._common import environment, save_result
from .batching_report import load_weights
from .native_rows import UNSHARED_MAX, copies_of, load

REPO = Path(__file__).resolve().parents[2]


def source_b(against: str, folder: Path) -> Path:
    """The B source: `against` where it names a file, else the copy of native/decode.cpp at git
    revision `against` (written into folder)."""
    path = Path(against)
    if path.is_file():
        return path
    try:
        relative = build.SOURCE.resolve().relative_to(REPO).as_posix()
    except ValueError:                         # the package installed outside this checkout
        raise SystemExit(f"--against {against!r} is not a file, and {build.SOURCE} is not in {REPO}'s git tree") from None
    try:
        done = subprocess.run(["git", "show", f"{against}:{relative}"], cwd=REPO, capture_output=True, text=True)
        why = done.stderr.strip() if done.returncode != 0 else None
    except OSError as err:                     # no git
        why = str(err)
    if why is not None:
        raise SystemExit(f"--against {against!r}: neither a file nor a git revision with {relative} ({why})")
    out = folder / "decode_b.cpp"
    out.write_text(done.stdout)
    return out


def decoder(adapter: ModelAdapter, source: Path, isa: str, threads: int) -> NativeDecoder:
    lib, reason = build.load_from(source, isa)
    if lib is None:
        raise SystemExit(f"{source}: {reason}")
    return NativeDecoder(adapter, lib, threads)


def same(a, b) -> bool:
    """Outputs of the two builds equal bit for bit (a tensor, or a list of them)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a is not None and b is not None and len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


OWN_TOKENS = 32          # each paged sequence's own tokens past the shared blocks (a question)
BLOCK_TOKENS = EngineConfig().block_tokens    # the pool's block, as the engine's default


def paged_rows(adapter: ModelAdapter, prefill, ids: list[int], context: int, m: int, vocab: int) -> list[tuple]:
    """m (sequence, token, position) rows of the engine's pool: the first `context` ids rounded down to
    whole blocks prefilled once (by `prefill`), their blocks mapped into every sequence (as cached
    blocks are), then OWN_TOKENS tokens of each sequence's own; each row's new token goes to its own slot."""
    b = BLOCK_TOKENS
    shared = context - context % b
    blocks = shared // b + m * -(-(OWN_TOKENS + 1) // b)
    pool = BlockPool(adapter.geometry, blocks * b * adapter.geometry.bytes_per_token, adapter.device, block_tokens=b)
    prefix = PagedSequence(pool, shared)
    prefix.reserve()
    prefill(prefix, ids[:shared], 0)
    rows = []
    for r in range(m):
        seq = PagedSequence(pool, shared + OWN_TOKENS + 1)
        seq.map_shared(prefix.cache_blocks(0, shared))
        seq.reserve()
        prefill(seq, [(2000 + 101 * r + 7 * j) % vocab for j in range(OWN_TOKENS)], shared)
        rows.append((seq, 5 + r, shared + OWN_TOKENS))
    return rows


def model_of(weights: str, gguf: str | None):
    """The default model (weights fp32 or int4), or the GGUF file at `gguf` as stored."""
    if gguf is None:
        return load(weights)
    if not Path(gguf).is_file():
        raise SystemExit(f"--gguf {gguf}: no such file")
    return load_weights("gguf", gguf)[0]


def measure(model, sources: dict, isa: str, context: int, rows: list[int], prefill: int, rounds: int,
            steps: int, threads: int) -> dict:
    adapter = ModelAdapter(model)
    reason = unsupported_reason(adapter)
    if reason is not None:
        raise SystemExit(f"the native step cannot run this model: {reason}")
    decoders = {name: decoder(adapter, path, isa, threads) for name, path in sources.items()}
    vocab = int(model.config.vocab_size)
    ids = [(1000 + 7 * i) % vocab for i in range(max(context, prefill))]
    with torch.inference_mode():
        kv = SequenceKV(adapter.geometry, context + 8, adapter.device)
        decoders["A"].prefill(kv, ids[:context], 0)
        copies = copies_of(kv, adapter, context, min(UNSHARED_MAX, max(rows)))
        # the shared rows all write their K and V into one slot (the KV's next), so they take one token:
        # different tokens there would make the slot's contents, and the outputs, depend on which
        # thread wrote last
        cases = {f"shared {m}": (lambda d, m=m: d.decode_rows([(kv, 5, context)] * m)) for m in rows}
        cases.update({f"unshared {m}": (lambda d, m=m: d.decode_rows([(copies[i], 5 + i, context) for i in range(m)]))
                      for m in rows if m <= UNSHARED_MAX})
        for m in rows:
            if m <= UNSHARED_MAX:
                paged = paged_rows(adapter, decoders["A"].prefill, ids, context, m, vocab)
                cases[f"paged {m}"] = lambda d, paged=paged: d.decode_rows(paged)
        off = decoders["A"].prefill_off        # float32 prompt chunks on PyTorch's products in the engine here
        if prefill:
            # timed natively either way; where the engine runs them on PyTorch, the case's name says so
            name = f"prefill {prefill}" + ("" if off is None else " (not the engine's path here)")
            cases[name] = lambda d: d.prefill(SequenceKV(adapter.geometry, prefill + 8, adapter.device), ids[:prefill], 0)
        identical = {case: same(run(decoders["A"]), run(decoders["B"])) for case, run in cases.items()}   # (warm-up)
        times: dict = {(case, name): [] for case in cases for name in decoders}
        for r in range(rounds):
            for case, run in cases.items():
                calls = 1 if case.startswith("prefill") else steps
                for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                    start = time.perf_counter()
                    for _ in range(calls):
                        run(decoders[name])
                    times[(case, name)].append((time.perf_counter() - start) / calls)
    for d in decoders.values():
        d.close()
    out = []
    for case in cases:
        a, b = times[(case, "A")], times[(case, "B")]
        ratios = sorted(y / x for x, y in zip(a, b))
        out.append({"case": case, "a_ms": round(1000 * statistics.median(a), 3), "b_ms": round(1000 * statistics.median(b), 3),
                    "b_over_a": round(statistics.median(ratios), 3), "b_over_a_range": [round(ratios[0], 3), round(ratios[-1], 3)],
                    "identical_outputs": identical[case]})
    return {"cases": out, "engine_prefill": "native" if off is None else off}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="B: a copy of decode.cpp, or a git revision (its copy)")
    parser.add_argument("--source", default=str(build.SOURCE), help="A: the package's decode.cpp unless given")
    parser.add_argument("--weights", default="int4", help="fp32 or int4 (the default model)")
    parser.add_argument("--gguf", help="a GGUF file as stored, instead of the default model")
    parser.add_argument("--isa", default="", help="the variant both are built for (default: the best this CPU runs)")
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="context 64, rows 1,2, prefill 16, 2 rounds of 2 steps")
    parser.add_argument("--out", default="benchmarks/results/native_ab.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.context, args.rows, args.prefill, args.rounds, args.steps = 64, "1,2", 16, 2, 2
    if args.context < BLOCK_TOKENS:
        raise SystemExit(f"--context must be at least {BLOCK_TOKENS} (a block of the paged cases)")
    isas, reason = build.candidates(args.isa or None)
    if not isas:
        raise SystemExit(f"the native step cannot run here: {reason}")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        sources = {"A": Path(args.source), "B": source_b(args.against, Path(folder))}
        result: dict = {"command": "python -m benchmarks.micro.native_ab " + " ".join(sys.argv[1:] if argv is None else argv),
                        "a": str(sources["A"]), "b": args.against, "isa": isas[0],
                        "weights": f"gguf:{args.gguf}" if args.gguf else args.weights,
                        "context": args.context, "rounds": args.rounds, "steps": args.steps,
                        **measure(model_of(args.weights, args.gguf), sources, isas[0], args.context,
                                  [int(m) for m in args.rows.split(",")], args.prefill, args.rounds, args.steps,
                                  args.threads)}
    for c in result["cases"]:
        lo, hi = c["b_over_a_range"]
        print(f"{c['case']:14s} A {c['a_ms']:9.3f} ms  B {c['b_ms']:9.3f} ms  B/A {c['b_over_a']:.3f} ({lo:.3f}-{hi:.3f})  "
              f"outputs {'identical' if c['identical_outputs'] else 'differ'}", flush=True)
    if result["engine_prefill"] != "native":
        print(f"the engine's prompt chunks here: {result['engine_prefill']}", flush=True)
    result["environment"] = environment(torch.nn.Linear(1, 1))
    if not args.smoke:
        print("wrote", save_result(result, args.out, "native_ab"))


if __name__ == "__main__":
    main()
