"""Gemma 3 (tiny random config): sliding-window and global layers with their own RoPE bases.

Window 16, every third layer global: the prompts here run far past the window.
"""
import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from kvboost_engine import Engine, UnsupportedModelError
from kvboost_engine.loading import default_model_dir
from kvboost_engine.model.arch import ModelAdapter, check_supported
from kvboost_engine.model.forward import Forward
from tiny_models import tiny_model

WINDOW = 16
SYSTEM = "A conversation between a curious user and a helpful assistant about rivers and mountains.\n"
QUESTIONS = ["How long is the Nile?", "Which river is the widest?", "Name a mountain in Peru.",
             "How high is it?", "What about glaciers there?", "Do rivers freeze in winter?",
             "Which lake is the deepest?", "Thanks, and one last thing: why is the sea salty?"]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.fixture(scope="module")
def gemma():
    return tiny_model("gemma3_text")


def transcript(turns: list[tuple[str, list[int] | None]], tokenizer) -> list[dict]:
    """A plain-text chat as prompt segments: each reply is its own assistant segment."""
    segments = [{"text": SYSTEM, "kind": "system"}]
    for question, reply in turns:
        segments.append({"text": f"User: {question}\nAssistant:", "kind": "user"})
        if reply is not None:
            segments.append({"text": tokenizer.decode(reply), "kind": "assistant"})
            segments.append({"text": "\n", "kind": "glue"})
    return segments


def chat_by_generate(engine: Engine, tokenizer, new_tokens: int = 6) -> list:
    turns, replies = [], []
    for question in QUESTIONS:
        g = engine.generate(transcript(turns + [(question, None)], tokenizer), max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens)
        replies.append(g)
        turns.append((question, g.token_ids))
    return replies


# ---- the layer loop matches transformers ------------------------------------------------------
def test_plain_hf_calls_behave_as_before_wrapping(gemma, tokenizer):
    """A model switched to our attention keeps its sliding-window masks on plain HF calls."""
    ids = torch.randint(3, 49000, (1, 5 * WINDOW), generator=torch.Generator().manual_seed(0))
    for original in ("eager", "sdpa"):
        model = tiny_model("gemma3_text")
        model.set_attn_implementation(original)
        with torch.inference_mode():
            before = model(ids).logits
            generated = model.generate(ids, max_new_tokens=6, do_sample=False)
        Engine(model, tokenizer, cache_bytes=0)
        assert model.config._attn_implementation == f"kvboost_{original}"
        with torch.inference_mode():
            assert torch.equal(model(ids).logits, before), original
            assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), generated), original


def test_engine_logits_match_transformers_past_the_window(gemma, tokenizer):
    engine = Engine(gemma, tokenizer, cache_bytes=0)
    prompt = "Rivers carry water from the mountains down to the sea, slowly. " * 8
    ids = engine.encode_prompt(prompt).token_ids
    assert len(ids) > 4 * WINDOW
    with torch.inference_mode():
        reference = gemma(torch.tensor([ids])).logits[0, -1]
    ours = engine.next_token_logits(prompt)
    assert torch.allclose(ours, reference, atol=1e-5)
    assert ours.abs().max() <= gemma.config.final_logit_softcapping       # the final softcap is applied


def test_pieces_of_gemma_are_where_transformers_put_them(gemma):
    adapter = ModelAdapter(gemma)
    assert adapter.layer_windows == (WINDOW, WINDOW, None) * 2
    assert adapter.layer_rope_kinds == ("sliding_attention", "sliding_attention", "full_attention") * 2
    assert adapter.geometry.head_dim == 32 and adapter.geometry.kv_heads == 2
    ids = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():             # the embedding module scales by sqrt(hidden) itself
        scaled = adapter.embed(ids)
        assert torch.allclose(scaled, gemma.model.embed_tokens.weight[ids] * 64 ** 0.5)
        rope = adapter.position_embeddings(scaled, torch.arange(3)[None])
    assert set(rope) == {"sliding_attention", "full_attention"}
    assert not torch.equal(rope["sliding_attention"][1], rope["full_attention"][1])


@pytest.mark.parametrize("option, value, match", [
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
    ("use_bidirectional_attention", True, "bidirectional"),
])
def test_gemma_options_we_do_not_reproduce_are_refused_from_the_config(option, value, match):
    config = AutoConfig.for_model("gemma3_text", **{option: value})
    with pytest.raises(UnsupportedModelError, match=match):
        check_supported(config)


def test_a_base_model_without_chat_template_generates_but_refuses_chat(gemma):
    """Like the real Gemma 3 270M, whose GGUF carries no chat template."""
    from kvboost_engine import InputError
    base_tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    base_tokenizer.chat_template = None
    engine = Engine(gemma, base_tokenizer, cache_bytes=0)
    with pytest.raises(InputError, match="no chat template; use generate"):
        engine.chat([{"role": "user", "content": "Hi"}])
    assert engine.generate("The river", max_new_tokens=3, min_new_tokens=3).completion_tokens == 3


# ---- exact reuse ------------------------------------------------------------------------------
def test_eight_turn_chat_by_generate_is_identical_cached_and_uncached(gemma, tokenizer):
    memo = dict(reply_memo_entries=64)      # replies of random weights rarely re-tokenize to their own ids
    warm = chat_by_generate(Engine(gemma, tokenizer, cache_bytes=64 * 2**20, **memo), tokenizer)
    cold = chat_by_generate(Engine(gemma, tokenizer, cache_bytes=0, **memo), tokenizer)
    assert [g.token_ids for g in warm] == [g.token_ids for g in cold]
    assert warm[-1].prompt_tokens > 8 * WINDOW
    # each turn reuses the whole previous turn: its prompt and its reply (but the reply's last token,
    # which was sampled, never fed back)
    assert all(g.reused_tokens >= prev.prompt_tokens + len(prev.token_ids) - 1 for prev, g in zip(warm, warm[1:]))


@pytest.mark.parametrize("options", [dict(paged=False), dict(paged=True), dict(paged=True, gather_max_keys=0)],
                         ids=["contiguous", "paged", "paged-runs-merged-by-lse"])
def test_prompt_longer_than_the_window_reuses_exactly(gemma, tokenizer, options, monkeypatch):
    import kvboost_engine.kv.paged as paged_module
    options = dict(options)
    if "gather_max_keys" in options:         # attend block run by block run, merged by log-sum-exp
        monkeypatch.setattr(paged_module, "GATHER_MAX_KEYS", options.pop("gather_max_keys"))
    long = " ".join(f"Stone {i} of the bridge weighs {i * 13 % 89} kilograms." for i in range(25))
    cold = Engine(gemma, tokenizer, cache_bytes=0, **options)
    warm = Engine(gemma, tokenizer, cache_bytes=64 * 2**20, block_tokens=8, **options)
    first = warm.generate(long, max_new_tokens=8, min_new_tokens=8)
    assert first.prompt_tokens > 10 * WINDOW
    assert first.token_ids == cold.generate(long, max_new_tokens=8, min_new_tokens=8).token_ids
    longer = long + " The heaviest stone is"
    second = warm.generate(longer, max_new_tokens=8, min_new_tokens=8)
    assert second.reused_exact >= first.prompt_tokens - 1
    assert second.token_ids == cold.generate(longer, max_new_tokens=8, min_new_tokens=8).token_ids


def test_scattered_forward_matches_the_contiguous_one(gemma, tokenizer):
    """Computing every position through the scattered path (the repair's) gives the same logits."""
    from kvboost_engine.kv.contiguous import SequenceKV
    adapter = ModelAdapter(gemma)
    forward = Forward(adapter)
    ids = tokenizer("Snow falls on the high passes every winter. " * 6)["input_ids"]
    whole = forward(SequenceKV(adapter.geometry, len(ids), adapter.device), ids, 0)
    scattered = forward.scattered(SequenceKV(adapter.geometry, len(ids), adapter.device), ids,
                                  torch.arange(len(ids)), len(ids))
    assert torch.allclose(whole, scattered, atol=1e-5)


# ---- moved reuse ------------------------------------------------------------------------------
# each document starts and ends differently: a moved document is preceded by other text than where
# it was cached, and no shared opening words make its span start later than the document
TREES = ["Alder", "Birch", "Cedar", "Hemlock", "Juniper"]
DOCS = [f"{tree} valley notes. " + " ".join(f"Gauge {i} in valley {v} read {(v * 31 + i * 17) % 97} centimetres."
                                          for i in range(6)) + f" Last reading taken by warden {tree}"
        for v, tree in enumerate(TREES)]
# short ones (a little longer than the window) with a short question: the last token's two-layer
# receptive field reaches the first tokens of the last document's moved tail
SHORT_DOCS = [f"{tree} notes: gauge one read {11 + v} and gauge two read {40 + 3 * v}, says warden {tree}"
              for v, tree in enumerate(TREES)]


def as_segments(order, question="Which gauge read the most?", docs=DOCS):
    return ([{"text": "Use the notes.\n", "kind": "system"}]
            + [{"text": docs[i], "kind": "document"} for i in order]
            + [{"text": f"\nQ: {question}\nA:" if question else "\nA:", "kind": "text"}])


def moved_logits(model, tokenizer, order, question="Which gauge read the most?", docs=DOCS, **options):
    engine = Engine(model, tokenizer, cache_bytes=64 * 2**20, **options)
    engine.generate(as_segments(range(5), "Summarise.", docs), max_new_tokens=1)
    g = engine.generate(as_segments(order, question, docs), max_new_tokens=1)
    return g, engine.next_token_logits(as_segments(order, question, docs))


def window_only_model(window=WINDOW):
    """Two sliding-window layers: a token WINDOW - 1 or more into a moved span sees only span tokens
    in both layers, so its cached KV (re-rotated) is exactly what a full prefill computes."""
    return tiny_model("gemma3_text", num_hidden_layers=2, layer_types=["sliding_attention"] * 2,
                      sliding_window=window)


@pytest.mark.parametrize("docs, question", [(DOCS, "Which gauge read the most?"), (SHORT_DOCS, "")],
                         ids=["long-documents", "short-documents"])
def test_window_rule_moves_only_what_no_earlier_content_reaches(tokenizer, docs, question):
    model = window_only_model()
    cold = Engine(model, tokenizer, cache_bytes=0).next_token_logits(as_segments([3, 1, 4], question, docs))
    g, logits = moved_logits(model, tokenizer, [3, 1, 4], question, docs, moved_reuse="none")
    # the first W - 1 tokens of each of the (at most 3) moved spans are computed, not reused
    assert 0 < g.reused_moved <= g.prompt_tokens - g.reused_exact - 1 - (WINDOW - 1)
    assert g.recomputed == 0
    assert torch.allclose(logits, cold, atol=1e-5), (logits - cold).abs().max()


def test_moving_one_token_more_than_the_rule_allows_changes_the_logits(tokenizer, monkeypatch):
    """The rule is tight: moving the (W - 1)-th token of a span too makes the window-only model inexact."""
    import kvboost_engine.request.prefill as prefill_module
    rule = prefill_module.window_rule
    monkeypatch.setattr(prefill_module, "window_rule",
                        lambda spans, windows, cache: rule(spans, tuple(w - 1 for w in windows), cache))
    model = window_only_model()
    cold = Engine(model, tokenizer, cache_bytes=0).next_token_logits(as_segments([3, 1, 4], "", SHORT_DOCS))
    g, logits = moved_logits(model, tokenizer, [3, 1, 4], "", SHORT_DOCS, moved_reuse="none")
    assert g.reused_moved > 0
    assert (logits - cold).abs().max() > 1e-4


def test_spans_shorter_than_the_window_are_not_moved_unless_the_rule_is_off(tokenizer):
    model = window_only_model(window=256)
    g, _ = moved_logits(model, tokenizer, [3, 1, 4], moved_reuse="none")
    assert g.reused_moved == 0
    g, _ = moved_logits(model, tokenizer, [3, 1, 4], moved_reuse="none", moved_window_rule=False)
    assert g.reused_moved > 0


def test_moved_stats_count_only_what_the_window_rule_keeps(tokenizer):
    """stats() counted every span found as moved (moved_hits / moved_tokens) before the rule dropped
    or shortened it: Gemma 3 270M reported 298 moved tokens for a reply that moved none."""
    for window, rule in ((256, True), (WINDOW, True), (256, False)):
        engine = Engine(window_only_model(window), tokenizer, cache_bytes=64 * 2**20, moved_reuse="none",
                        moved_window_rule=rule)
        engine.generate(as_segments(range(5), "Summarise."), max_new_tokens=1)
        before = engine.stats()
        g = engine.generate(as_segments([3, 1, 4], ""), max_new_tokens=1)
        moved = engine.stats()["moved_tokens"] - before["moved_tokens"]
        assert moved == g.reused_moved, (window, rule, moved, g.reused_moved)
        assert (engine.stats()["moved_hits"] > before["moved_hits"]) == (g.reused_moved > 0)
        engine.close()


def test_full_repair_on_gemma_equals_no_cache(gemma, tokenizer):
    """Every moved token recomputed: re-rotation per layer type and windowed scatter attention are right."""
    cold = Engine(gemma, tokenizer, cache_bytes=0).next_token_logits(as_segments([3, 1, 4]))
    g, logits = moved_logits(gemma, tokenizer, [3, 1, 4], moved_reuse="blend", recompute_ratio=1.0)
    assert g.reused_moved > 0
    assert torch.allclose(logits, cold, atol=1e-4)
