"""Raw measurements -> per-request medians and per-workload summaries with their spread.

Spread: a summary figure is computed once per repeat (e.g. the median TTFT over all requests
of that repeat); the reported value is the median of those, and the spread is their min-max.
Agreement compares each reply with plain transformers' reply to the same request in the same
process.
"""
from __future__ import annotations

import statistics

TIMES = ("ttft_s", "total_s", "decode_tok_s")


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _spread(per_repeat: list) -> dict:
    values = [v for v in per_repeat if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def request_rows(runs: list[list[dict]], baseline: list[list[dict]] | None, answers: list[str]) -> list[dict]:
    """One row per request of a sequence: medians over repeats, min-max, reuse, agreement."""
    rows = []
    for i in range(len(runs[0])):
        seen = [run[i] for run in runs]
        first = seen[0]
        row = {key: _spread([s[key] for s in seen]) for key in TIMES}
        row.update({k: first[k] for k in ("prompt_tokens", "reused_tokens", "reused_exact", "reused_moved",
                                          "hit_rate", "new_tokens", "text")})
        if baseline is not None:
            row["agrees"] = first["text"] == baseline[0][i]["text"]
        if answers[i]:
            row["correct"] = answers[i].lower() in first["text"].lower()
        rows.append(row)
    return rows


def summary(runs_by_seq: dict[str, list[list[dict]]], baseline_by_seq: dict | None, rows_by_seq: dict) -> dict:
    """Per-workload figures over all its sequences, each with its spread over repeats."""
    repeats = min(len(runs) for runs in runs_by_seq.values())
    out = {}
    for key in TIMES:
        out[key] = _spread([_median([req[key] for runs in runs_by_seq.values() for req in runs[r]])
                            for r in range(repeats)])
    if baseline_by_seq is not None:
        ratios = []
        for r in range(repeats):
            ratios.append(_median([base[r][i]["ttft_s"] / runs[r][i]["ttft_s"]
                                   for seq, runs in runs_by_seq.items() for base in [baseline_by_seq[seq]]
                                   for i in range(len(runs[r]))]))
        out["ttft_speedup"] = _spread(ratios)
    rows = [row for seq_rows in rows_by_seq.values() for row in seq_rows]
    prompt = sum(r["prompt_tokens"] for r in rows)
    out["prompt_tokens"] = prompt
    out["reused_share"] = sum(r["reused_tokens"] for r in rows) / max(1, prompt)
    out["moved_share"] = sum(r["reused_moved"] for r in rows) / max(1, prompt)
    if rows and "agrees" in rows[0]:
        out["agreement"] = sum(r["agrees"] for r in rows) / len(rows)
    if rows and "correct" in rows[0]:
        out["accuracy"] = sum(r["correct"] for r in rows) / len(rows)
    out["requests"] = len(rows)
    out["repeats"] = repeats
    return out


def aggregate_group(raw: dict, workloads: list, baseline_id: str = "transformers") -> dict:
    """{system: {workload: {"summary", "sequences": {key: [rows]}}}} for one process's raw results."""
    result = {}
    baseline = raw.get(baseline_id)
    for system_id, by_workload in raw.items():
        result[system_id] = {}
        for workload in workloads:
            runs_by_seq = by_workload[workload.name]
            base_by_seq = baseline[workload.name] if baseline is not None else None
            rows_by_seq = {}
            for seq in workload.sequences:
                answers = [req.answer for req in seq.requests]
                base = base_by_seq[seq.key] if base_by_seq is not None else None
                rows_by_seq[seq.key] = request_rows(runs_by_seq[seq.key], base, answers)
            result[system_id][workload.name] = {"summary": summary(runs_by_seq, base_by_seq, rows_by_seq),
                                                "sequences": rows_by_seq}
    return result


def series(rows: list[dict], key: str) -> list:
    """The median of `key` per request (for plots)."""
    return [row[key]["median"] if isinstance(row[key], dict) else row[key] for row in rows]


def sequence_median(rows: list[dict], key: str) -> float | None:
    return _median(series(rows, key))
