"""The accuracy-TTFT frontier of moved reuse per warm-up regime, from moved_regimes results.

Reads the JSON files that `python -m benchmarks.research.moved_regimes` writes (one per regime and
model), prints one Markdown table per model (accuracy, gap to no cache with its paired standard
error, TTFT speedup over no cache, agreement of the greedy reply with no cache's) and draws one
panel per regime: accuracy gap against median TTFT speedup, a point per configuration, the exact
configurations (no cache, default, cache-aware order) at zero cost to answers by construction or
by measurement. A configuration is on the frontier when no other one of the same model and regime
is both faster and at least as accurate.

Run: python -m benchmarks.research.frontier benchmarks/results/moved_regimes_*_cpu*.json
     [--plot benchmarks/results/moved_frontier.png]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

REGIME_ORDER = ("alone", "groups", "earlier", "shared")
LABELS = {"no-cache": "no cache", "exact": "exact (default)", "cache-order": "cache-aware order",
          "none": "`none`", "blend-0.15": "blend 15% (+4 head)", "blend-0.3": "blend 30%",
          "head-16": "15% + first 16", "head-32": "15% + first 32", "attention-0.15": "15% by attention"}


def load(paths: list[str]) -> list[dict]:
    results = [json.loads(Path(p).read_text()) for p in paths]
    for r, p in zip(results, paths):
        if r.get("benchmark") != "moved_regimes":
            raise SystemExit(f"{p}: not a moved_regimes result")
    return sorted(results, key=lambda r: (r["environment"]["model"], REGIME_ORDER.index(r["regime"])))


def on_frontier(summary: list[dict]) -> set[str]:
    """Configurations no other one beats on both TTFT speedup and accuracy."""
    keep = set()
    for s in summary:
        beaten = any(o is not s and o["median_ttft_speedup"] > s["median_ttft_speedup"]
                     and o["accuracy"] >= s["accuracy"] for o in summary)
        if not beaten:
            keep.add(s["config"])
    return keep


def table(results: list[dict]) -> str:
    """One Markdown table per model: a row per regime, a cell per configuration."""
    out = []
    for model in dict.fromkeys(r["environment"]["model"] for r in results):
        rows = [r for r in results if r["environment"]["model"] == model]
        configs = list(dict.fromkeys(s["config"] for r in rows for s in r["summary"]))
        out.append(f"{model}: accuracy % (gap to no cache ± paired SE, points) / median TTFT speedup over no cache; "
                   "* on the frontier\n")
        out.append("| regime | questions | " + " | ".join(LABELS.get(c, c) for c in configs) + " |")
        out.append("|---|---|" + "---|" * len(configs))
        for r in rows:
            by = {s["config"]: s for s in r["summary"]}
            best = on_frontier(r["summary"])
            cells = []
            for c in configs:
                s = by.get(c)
                if s is None:
                    cells.append("not run")
                    continue
                mark = "*" if c in best else ""
                gap = "" if c == "no-cache" else f" ({100 * s['accuracy_gap']:+.1f} ± {100 * s['accuracy_gap_se']:.1f})"
                cells.append(f"{100 * s['accuracy']:.1f}{gap} / {s['median_ttft_speedup']:.2f}x{mark}")
            out.append(f"| {r['regime']} | {r['questions']} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    regimes = [g for g in REGIME_ORDER if any(r["regime"] == g for r in results)]
    fig, axes = plt.subplots(1, len(regimes), figsize=(4.2 * len(regimes), 4), squeeze=False)
    for ax, regime in zip(axes[0], regimes):
        for marker, r in zip("os^v", [r for r in results if r["regime"] == regime]):
            points = sorted(r["summary"], key=lambda s: s["median_ttft_speedup"])
            xs = [s["median_ttft_speedup"] for s in points]
            ys = [100 * s["accuracy_gap"] for s in points]
            ax.errorbar(xs, ys, yerr=[100 * s["accuracy_gap_se"] for s in points], fmt=marker, capsize=2,
                        label=f"{r['environment']['model'].split(' (')[0]} ({r['questions']} q)")
            for x, y, s in zip(xs, ys, points):
                ax.annotate(s["config"], (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.axhline(0, color="gray", linestyle="--", linewidth=0.8)
        ax.set(title=f"regime: {regime}", xlabel="median TTFT speedup over no cache", ylabel="accuracy gap (points)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="moved_regimes JSON files")
    parser.add_argument("--plot", help="write the frontier figure here (PNG)")
    args = parser.parse_args(argv)
    results = load(args.results)
    print(table(results))
    if args.plot:
        plot(results, Path(args.plot))


if __name__ == "__main__":
    main()
