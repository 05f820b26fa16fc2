"""python -m benchmarks.remote's plumbing on two in-process fake servers: workloads, both
comparisons, the JSON and the markdown report."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("openai")
pytest.importorskip("langchain_openai")

from fake_openai_server import FakeServer  # noqa: E402

from benchmarks.remote import workloads  # noqa: E402
from benchmarks.remote.remote import main  # noqa: E402


def test_workloads_send_the_same_conversation_to_both_systems():
    for requests in (workloads.chat(3, 2, "t", clock=True), workloads.chat_docs(3, 2, "t"),
                     workloads.rag(3, 4, 8, "t")):
        for request in requests:
            ours = [m.content if isinstance(m.content, str) else "\n\n".join(b["text"] for b in m.content)
                    for m in request.ours]
            assert ours == [m.content for m in request.peer]
    clock = workloads.chat(2, 2, "t", clock=True)
    assert clock[0].ours[0].content != clock[1].ours[0].content      # the clock line changes every request


def test_quick_run_on_fake_servers(tmp_path):
    with FakeServer() as a, FakeServer() as b:
        main(["--quick", "--endpoints", a.url, b.url, "--out", str(tmp_path / "remote.json")])
    results = json.loads((tmp_path / "remote.json").read_text())
    single, routed = results["single"], results["replicas"]
    assert set(single) == {"chat", "chat-clock", "rag"} and set(routed) == {"chat", "chat-docs", "rag"}
    clock = single["chat-clock"]
    assert clock["ours"]["summary"]["hit_rate"] > clock["ChatOpenAI"]["summary"]["hit_rate"]
    assert clock["ours"]["summary"]["server"]["hits"] == clock["ours"]["summary"]["cached_tokens"]
    # Cache-aware routing keeps each conversation on one replica (which replica depends on the
    # ring over the servers' random ports, so several conversations may share one) and so hits
    # the cache more than round-robin, which alternates replicas between turns.
    docs = routed["chat-docs"]
    for name in ("cache", "round_robin"):
        assert all(row["replica"] for row in docs[name]["rows"])
    homes = {}
    for row in docs["cache"]["rows"]:
        homes.setdefault(row["label"].split(" turn ")[0], set()).add(row["replica"])
    assert len(homes) == 3 and all(len(replicas) == 1 for replicas in homes.values())
    assert docs["round_robin"]["summary"]["replicas_used"] == 2
    assert docs["cache"]["summary"]["hit_rate"] > docs["round_robin"]["summary"]["hit_rate"]
    text = (tmp_path / "remote.md").read_text()
    assert "cache-aware routing vs round-robin" in text and "ChatOpenAI" in text
