"""The load test's plumbing without a model: its plan, a client process's outcomes against the fake
server (completed, cancelled, disconnected; no errors), the summary and the /metrics parsing."""
from __future__ import annotations

import pytest

pytest.importorskip("openai")

from benchmarks.serve import load  # noqa: E402
from benchmarks.serve.clients import run_client  # noqa: E402
from benchmarks.serve.workload import KINDS, plan  # noqa: E402
from kvboost_tools.fake_openai import FakeServer  # noqa: E402


def test_plan_is_seeded_and_mixes_kinds():
    first = plan(0, 1, 2, 40)
    assert first == plan(0, 1, 2, 40) and first != plan(0, 1, 3, 40)
    assert {r.kind for r in first} == set(KINDS)
    rag = next(r for r in first if r.kind == "rag")
    assert [p["type"] for p in rag.messages[-1]["content"]] == ["document", "document", "text"]


def test_client_outcomes_against_the_fake_server():
    # chunks 0.35 s apart: a disconnecting client (0.3 s) gives up; seed 2 draws every kind in 15 requests
    with FakeServer(reply="one two three four five six seven eight", chunk_delay_s=0.35) as fake:
        outcome = run_client(fake.url, fake.model, client=0, streams=3, requests=5, seed=2, max_tokens=2)
    assert outcome["errors"] == []
    assert outcome["completed"] > 0 and outcome["cancelled"] > 0 and outcome["disconnected"] > 0
    assert outcome["completed"] + outcome["cancelled"] + outcome["disconnected"] == 15
    summary = load.summarize(load.merge([outcome, outcome]), seconds=2.0)
    assert summary["requests"]["completed"] == 2 * outcome["completed"] and summary["errors"] == 0
    assert summary["ttft_s"]["n"] == 2 * len(outcome["ttft_s"])


def test_gauges_read_kv_bytes_by_holder(monkeypatch):
    text = ('# HELP kvboost_kv_bytes x\nkvboost_kv_bytes{holder="in_use"} 0\nkvboost_kv_bytes{holder="cached"} 64\n'
            'kvboost_requests_running 0\nkvboost_requests_total{route="chat",status="200"} 3\n')
    monkeypatch.setattr(load, "_get", lambda port, path: text)
    assert load.gauges(0) == {"kv_bytes.in_use": 0.0, "kv_bytes.cached": 64.0, "kvboost_requests_running": 0.0}
