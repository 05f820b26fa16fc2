"""The side-by-side benchmark's plumbing, without a model: workloads, aggregation, report, README."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.data import coding as coding_data
from benchmarks.sidebyside import aggregate, report
from benchmarks.research.moved_quality import completion_for, configurations, paired_gap
from benchmarks.sidebyside.workloads import Workload, chat_workload, coding_workload, flat_messages, rag_workload


def _workloads():
    return [chat_workload(3, 8, lambda messages: f"reply {len(messages)}"),
            rag_workload((1, 3), 2, 8), coding_workload(6, 8)]


def test_chat_replay_grows_one_turn_at_a_time():
    chat = _workloads()[0]
    requests = chat.sequences[0].requests
    assert [len(r.messages) for r in requests] == [2, 4, 6]
    assert requests[2].messages[:5] == requests[1].messages + [{"role": "assistant", "content": "reply 4"}]


def test_rag_documents_recur_in_new_orders():
    rag = _workloads()[1]
    assert [s.x for s in rag.sequences] == [1, 3]
    parts = [r.messages[1]["content"] for r in rag.sequences[1].requests]
    assert all(len(p) == 4 and p[-1]["type"] == "text" for p in parts)     # 3 documents + the question
    assert all(r.answer for r in rag.sequences[1].requests)


def test_coding_session_edits_then_reorders():
    steps = _workloads()[2].sequences[0].requests
    files = [[p["text"].splitlines()[0] for p in r.messages[1]["content"][:-1]] for r in steps]
    edited = f"File {coding_data.EDITED_FILE}:"
    assert files[0] == files[coding_data.EDIT_STEP] and files[0].index(edited) > 0
    assert files[coding_data.REORDER_STEP][0] == edited
    assert steps[coding_data.EDIT_STEP].event.startswith("edit")
    before = steps[0].messages[1]["content"][files[0].index(edited)]["text"]
    after = steps[coding_data.EDIT_STEP].messages[1]["content"][files[0].index(edited)]["text"]
    assert before != after and "log.info" in after


def test_flat_messages_join_parts_like_the_engine():
    from kvboost_engine.request.prompt import PART_SEPARATOR
    messages = [{"role": "user", "content": [{"type": "document", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert flat_messages(messages) == [{"role": "user", "content": "a" + PART_SEPARATOR + "b"}]


def test_workload_round_trips_through_json():
    for workload in _workloads():
        assert Workload.from_json(json.loads(json.dumps(workload.to_json()))) == workload


def _fake_raw(workloads, speed: dict[str, float]):
    raw = {}
    for system, factor in speed.items():
        raw[system] = {}
        for w in workloads:
            raw[system][w.name] = {}
            for seq in w.sequences:
                runs = []
                for repeat in range(3):
                    runs.append([{"text": r.answer or "same", "prompt_tokens": 100, "reused_tokens": 0 if factor == 1 else 80,
                                  "reused_exact": 0 if factor == 1 else 80, "reused_moved": 0, "hit_rate": 0 if factor == 1 else 0.8,
                                  "new_tokens": 8, "ttft_s": factor * (1 + 0.1 * repeat), "total_s": 2 * factor,
                                  "decode_tok_s": 30.0} for r in seq.requests])
                raw[system][w.name][seq.key] = runs
    return raw


def _fake_result(workloads):
    group = aggregate.aggregate_group(_fake_raw(workloads, {"transformers": 1.0, "ours-engine": 0.25}), workloads)
    env = {"date": "2026-01-01", "cpu_model": "cpu", "cpu": "x86", "cpu_count": 2, "torch_threads": 2, "model": "m",
           "dtype": "torch.float32", "device": "cpu", "torch": "2", "transformers": "5", "load_average_start": 0.5,
           "load_average_end": 0.6, "wall_s": 60}
    systems = {s: {"label": s, "version": "1", "status": "ran", "memory": {"peak_rss_bytes": 2**30,
                                                                         "rss_after_load_bytes": 2**29}}
               for s in ("transformers", "ours-engine")}
    systems["kvboost-pypi"] = {"label": "kvboost", "version": "0.9.0", "status": "could not run: reason", "memory": None}
    return {"mode": "full", "settings": {"repeats": 3}, "environment": env, "systems": systems,
            "workloads": [w.describe() for w in workloads], "groups": {"main": group},
            "group_of": {s: "main" for s in systems}}


def test_summary_medians_spread_and_speedup():
    workloads = _workloads()
    result = _fake_result(workloads)
    s = result["groups"]["main"]["ours-engine"]["chat"]["summary"]
    assert s["ttft_s"] == pytest.approx({"median": 0.275, "min": 0.25, "max": 0.3})
    assert s["ttft_speedup"]["median"] == pytest.approx(4.0)
    assert s["reused_share"] == pytest.approx(0.8) and s["agreement"] == 1.0
    assert result["groups"]["main"]["ours-engine"]["rag"]["summary"]["accuracy"] == 1.0


def test_report_table_plots_and_readme(tmp_path, monkeypatch):
    workloads = _workloads()
    result = _fake_result(workloads)
    text = report.markdown(result)
    assert "could not run: reason" in text and "4.00×" in text and "275 (250–300)" in text
    path = report.write_all(result, tmp_path)
    assert json.loads(path.read_text())["mode"] == "full"
    assert all((tmp_path / f"{name}.png").stat().st_size > 1000 for name in report.PLOTS)
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{report.BEGIN}\nold\n{report.END}\nafter\n")
    monkeypatch.setattr(report, "ROOT", tmp_path)
    report.update_readme(result, readme, path)
    updated = readme.read_text()
    assert "old" not in updated and "275 (250–300)" in updated and updated.endswith(f"{report.END}\nafter\n")


def test_paired_gap_counts_only_discordant_answers():
    same = [True, False, True, False]
    assert paired_gap(same, same) == (0.0, 0.0)
    # 2 lost, 1 gained out of 10: gap -0.1; d has mean -0.1 and E[d^2] 0.3
    config = [False, False, True] + [True] * 3 + [False] * 4
    reference = [True, True, False] + [True] * 3 + [False] * 4
    gap, se = paired_gap(config, reference)
    assert gap == pytest.approx(-0.1)
    assert se == pytest.approx(((0.3 - 0.01) / 10) ** 0.5)
    with pytest.raises(ValueError):
        paired_gap([True], [True, False])


def test_moved_quality_configurations_name_their_strategy():
    configs = configurations((0.15,), window_rule=False)
    assert configs["blend-0.15"] == dict(moved_reuse="blend", recompute_ratio=0.15, moved_window_rule=False)
    assert configs["full"]["moved_reuse"] == "blend" and configs["full"]["recompute_ratio"] == 1.0
    assert configs["exact"] == dict(moved_reuse="full") and configs["no-cache"] == dict(cache_bytes=0)


def test_base_model_prompt_is_few_shot_with_documents_as_segments():
    segments = completion_for(["Doc one.", "Doc two."], "Who?")
    assert [s["kind"] for s in segments] == ["system", "document", "document", "text"]
    assert segments[0]["text"].count("\nAnswer: ") == 2 and segments[0]["text"].endswith("\n\n")
    assert segments[1]["text"] == "Document: Doc one.\n" and segments[-1]["text"] == "Question: Who?\nAnswer:"


def test_weights_table_states_deltas_failures_and_the_bound():
    from benchmarks.micro.weights import table
    rows = [{"format": "fp32", "decode_tok_s": 20.0, "prefill_tok_s": 300.0, "ttft_s": 0.2, "ppl_1k": 10.0,
             "ppl_2k": 9.0, "weights_bytes": 538e6, "peak_rss_bytes": 1e9},
            {"format": "int4", "decode_tok_s": 50.0, "prefill_tok_s": 250.0, "ttft_s": 0.1, "ppl_1k": 10.1,
             "ppl_2k": 9.0, "weights_bytes": 95e6, "peak_rss_bytes": 6e8, "native_decode": True},
            {"format": "llama.cpp Q4_1", "decode_tok_s": 60.0, "peak_rss_bytes": 5e8},
            {"format": "bf16", "status": "failed: boom"}]
    bound = {"decode_bytes": 538e6, "bytes_per_s": 5e9, "bound_s": 0.1076, "step_s": 0.05, "ratio": 2.152}
    text = table({"rows": rows, "bounds": {"fp32": bound}})
    assert "| int4 | native | 50.0 | 250.0 | 100 | 10.100 (+1.00%) | 9.000 (+0.00%) | - | 95 | 600 |" in text
    assert "| llama.cpp Q4_1 | - | 60.0 | - | - | - | - | - | - | 500 |" in text
    assert "failed: boom" in text and "fp32 decode bound" in text and "215% of the bound" in text


def test_generated_schemas_are_valid_deterministic_and_cover_the_asked_features():
    import jsonschema

    from benchmarks.micro.schemagen import SchemaGen, features
    schemas = [SchemaGen(0).schema(i) for i in range(200)]
    for schema in schemas:
        jsonschema.Draft202012Validator.check_schema(schema)
    assert schemas[7] == SchemaGen(0).schema(7) and schemas[7] != SchemaGen(1).schema(7)
    covered = set().union(*(features(s) for s in schemas))
    assert covered >= {"nested objects", "arrays beyond 5 items", "optional properties", "nullable", "enum",
                       "number bounds", "pattern", "maxLength"}


def test_schema_benchmark_summary_counts_outcomes_and_speed():
    from benchmarks.micro.schemas import summarize
    records = [{"outcome": "valid", "tokens": 10}, {"outcome": "length", "tokens": 256},
               {"outcome": "valid", "tokens": 20}]
    summary = summarize(records, [{"ratio": 0.95}, {"ratio": 1.01}, {"ratio": 0.99}])
    assert (summary["valid"], summary["length"], summary["invalid"]) == (2, 1, 0)
    assert summary["valid_share_of_finished"] == 1.0 and summary["speed_ratio_median"] == 0.99


def test_side_by_side_paths_point_at_the_repository():
    """The harness writes the README and benchmarks/results of the repository, and its memory
    workers start a module that runs (both broke when the regroup moved the harness down a folder)."""
    import importlib.util
    from benchmarks.sidebyside import sidebyside
    for root in (report.ROOT, sidebyside.ROOT):
        assert (root / "README.md").is_file() and (root / "benchmarks" / "results").is_dir()
    module = importlib.util.find_spec("benchmarks.sidebyside.sidebyside")
    assert module is not None and "def main" in Path(module.origin).read_text()


def test_transcript_keeps_documents_as_segments_and_joins_to_the_flat_text():
    from benchmarks.sidebyside.workloads import transcript, transcript_text
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "document", "text": "Doc A."}, {"type": "text", "text": "Q?"}]},
                {"role": "assistant", "content": "A."}, {"role": "user", "content": "More?"}]
    segments = transcript(messages)
    assert [s["text"] for s in segments if s["kind"] == "document"] == ["Doc A."]
    assert transcript_text(messages) == "".join(s["text"] for s in segments) == (
        "Be brief.\n\nUser:\nDoc A.\n\nQ?\nAssistant: A.\nUser: More?\nAssistant:")


def test_frontier_marks_configurations_nothing_beats_and_tabulates_each_regime():
    from benchmarks.research import frontier
    from benchmarks.research.moved_regimes import config_options

    def s(config, acc, speed):
        return {"config": config, "accuracy": acc, "accuracy_gap": acc - 0.3, "accuracy_gap_se": 0.02,
                "median_ttft_speedup": speed}
    summary = [s("no-cache", 0.3, 1.0), s("exact", 0.3, 1.2), s("none", 0.2, 3.0), s("blend-0.15", 0.19, 2.5),
               s("head-16", 0.25, 2.4)]
    assert frontier.on_frontier(summary) == {"exact", "none", "head-16"}     # blend-0.15: none is faster and better
    result = {"benchmark": "moved_regimes", "regime": "alone", "questions": 200,
              "environment": {"model": "M (x)"}, "summary": summary}
    text = frontier.table([result])
    assert "| alone | 200 | 30.0 / 1.00x | 30.0 (+0.0 ± 2.0) / 1.20x* |" in text and "not run" not in text
    assert config_options("head-16", window_rule=False) == {"moved_reuse": "blend", "recompute_ratio": 0.15,
                                                            "recompute_head_tokens": 16, "moved_window_rule": False}
    assert config_options("cache-order") == {}
    with pytest.raises(ValueError):
        config_options("blend")


def test_native_context_table_lists_each_weights_kv_and_context():
    from benchmarks.micro.native_context import table
    row = lambda a, b: {"native_ms": a, "pytorch_ms": b, "speedup": round(b / a, 2)}
    result = {"contexts": [500, 4000], "runs": {"int4, int8 KV": {"500": row(5.0, 250.0), "4000": row(8.0, 260.0)},
                                               "fp32, float32 KV": {"500": row(25.0, 75.0), "4000": row(35.0, 90.0)}}}
    lines = table(result).splitlines()
    assert "500 tokens" in lines[0] and "4000 tokens" in lines[0] and len(lines) == 4
    assert lines[2] == "| int4, int8 KV | 5.0 / 250.0 (50.0x) | 8.0 / 260.0 (32.5x) |"


def test_batching_system_tokens_sets_the_prompt_length_and_refuses_nonsense(tmp_path, capsys, monkeypatch):
    from benchmarks.micro import batching

    for name in ("NEW_TOKENS", "SYSTEM_TOKENS", "PAIRS", "COMPLETION"):      # main sets them: put back after
        monkeypatch.setattr(batching, name, getattr(batching, name))
    monkeypatch.setattr(batching, "ENGINE_OPTIONS", {})
    out = tmp_path / "batching.json"
    batching.main(["--smoke", "--weights", "int4", "--system-tokens", "48", "--sections", "unshared",
                   "--kv-pool-gib", "0.5", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["system_tokens"] == 48
    assert result["kv_pool_bytes"] == 2**29 and result["cache_bytes"] == "default"
    assert result["int4"]["unshared"]["system_tokens_each"] == 48
    assert result["int4"]["unshared"]["greedy_same_as_serial"]
    with pytest.raises(SystemExit):
        batching.main(["--system-tokens", "0", "--out", str(tmp_path / "never.json")])
    assert "--system-tokens must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "never.json").exists()


def test_llama_batched_bench_sizes_follow_the_prompt_length():
    from benchmarks.micro.batching_report import LLAMA_SIZE, llama_sizes

    assert llama_sizes(None) == LLAMA_SIZE                       # 400 tokens, as every earlier run
    sizes = llama_sizes(4000)
    assert sizes[sizes.index("-npp") + 1] == "4000"
    assert int(sizes[sizes.index("-c") + 1]) >= 8 * (4000 + 48)   # 8 unshared sequences and their new tokens fit


def test_step_read_bytes_leaves_out_a_derived_m_stored_or_not():
    """A GGUF's Q4_0 / Q8_0 matrices store no m (None): the step's bytes are still counted (the
    unshared section's read bound at a real size failed on them)."""
    import torch
    from torch import nn

    from benchmarks.micro.batching_report import step_read_bytes
    from kvboost_engine.weights.packed import PackedLinear, pack_codes

    n = k = 256
    codes = torch.zeros(n, k, dtype=torch.uint8)
    d = torch.ones(n, k // 32)
    packed = pack_codes(codes, d, -8 * d, 4, torch.float16, torch.float16)
    without_m = PackedLinear(packed["codes"], packed["d"], None, 4, n, k, zero_code=8)
    with_m = PackedLinear(packed["codes"].clone(), packed["d"].clone(), packed["m"], 4, n, k, zero_code=8)
    plain = nn.Linear(k, n, bias=False)
    size = lambda t: t.numel() * t.element_size()
    expected = 2 * (size(packed["codes"]) + size(packed["d"])) + size(plain.weight)     # not the stored m
    assert step_read_bytes(nn.Sequential(without_m, with_m, plain)) == expected


def test_batching_summary_names_llama_prompt_or_that_it_did_not_run():
    from benchmarks.micro.batching_report import summary

    ran = {"weights": [], "system_tokens": 48, "llama": {"shared": {"rows": [{"pp": 48, "pl": 8, "speed_tg": 1.0}]}}}
    assert "(its prompt 48 tokens, 48 new;" in summary(ran)["note"]
    assert "(not run in this run;" in summary({"weights": [], "system_tokens": 48})["note"]


def test_every_module_a_benchmark_runs_as_a_child_exists():
    """awq_streaming ran its measurement as `-m benchmarks.awq_streaming`, a module moved to
    benchmarks/micro/: the README's command failed at once with "No module named ..."."""
    import importlib.util
    import re
    root = Path(__file__).resolve().parents[1]
    named = {m for f in root.rglob("*.py") for m in re.findall(r'"-m",\s*"(benchmarks(?:\.\w+)+)"', f.read_text())}
    assert {"benchmarks.micro.awq_streaming", "benchmarks.micro.gguf"} <= named
    assert [m for m in sorted(named) if importlib.util.find_spec(m) is None] == []
