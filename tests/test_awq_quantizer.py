"""Our quantizer's parts: layer-by-layer calibration, scale search, clipping, error-feedback rounding."""
from __future__ import annotations

import torch
from torch import nn

from kvboost_tools.awq.calibrate import first_layer_inputs, run_layer
from kvboost_engine.weights.awq.format import dequantize
from kvboost_tools.awq.grid import fake_quantize, pack_groups, round_groups
from kvboost_tools.awq.quantize import SearchOptions, quantize_model
from kvboost_tools.awq.rounding import feedback_round, second_moment
from kvboost_tools.awq.search import ScaleGroup, apply_scale, search_scale
from tiny_models import tiny_model

GEN = torch.Generator().manual_seed(7)


def outlier_inputs(tokens: int = 512, k: int = 64) -> torch.Tensor:
    x = torch.randn(tokens, k, generator=GEN)
    x[:, 3] *= 40                                        # one channel with large activations
    return x


def test_chained_layers_reproduce_the_model():
    model = tiny_model("llama")
    ids = torch.randint(0, 1000, (2, 12), generator=GEN)
    inputs = first_layer_inputs(model, ids)
    hidden = inputs.hidden
    for layer in model.model.layers:
        hidden, features = run_layer(layer, type(inputs)(hidden, inputs.kwargs), capture=True)
    with torch.no_grad():
        want = model(ids, output_hidden_states=True, use_cache=False).hidden_states
    assert torch.allclose(model.model.norm(hidden), want[-1], atol=1e-5)
    assert features["mlp.down_proj"].shape == (24, 128) and "cache" not in inputs.kwargs


def test_scale_search_beats_plain_rounding_on_outlier_channel():
    linear = nn.Linear(64, 32, bias=False)
    x = outlier_inputs()
    scales, errors = search_scale(ScaleGroup(nn.Identity(), [linear], "x"), x, 32)
    assert min(errors) <= errors[0] and min(errors) < 0.9 * errors[0]       # errors[0]: no scaling
    assert int(scales.argmax()) == 3
    with torch.no_grad():
        scaled = fake_quantize(linear.weight * scales, 32) / scales
        plain = fake_quantize(linear.weight, 32)
        assert (x @ (scaled - linear.weight).T).pow(2).mean() < (x @ (plain - linear.weight).T).pow(2).mean()


def test_apply_scale_keeps_the_float_function():
    norm, up, down = nn.LayerNorm(16), nn.Linear(16, 24), nn.Linear(24, 8)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(5, 16, generator=GEN)
    with torch.no_grad():
        before = down(up(norm(x)))
        apply_scale(norm, [up], torch.rand(16, generator=GEN) + 0.5)
        apply_scale(up, [down], torch.rand(24, generator=GEN) + 0.5)
        assert torch.allclose(down(up(norm(x))), before, atol=1e-5)


def test_feedback_rounding_lowers_output_error():
    weight = torch.randn(48, 128, generator=GEN)
    x = outlier_inputs(1024, 128) @ (torch.eye(128) + 0.2 * torch.randn(128, 128, generator=GEN))
    q, zeros, scales = feedback_round(weight, second_moment(x), 32)
    assert q.min() >= 0 and q.max() <= 15 and q.shape == (48, 4, 32)
    feedback = ((q - zeros[..., None]) * scales[..., None]).reshape(weight.shape)
    assert torch.equal(dequantize(*pack_groups(q, zeros, scales), 32).T, feedback)
    nearest = fake_quantize(weight, 32)
    assert (x @ (feedback - weight).T).pow(2).mean() < 0.8 * (x @ (nearest - weight).T).pow(2).mean()


def test_feedback_rounding_without_correlation_is_nearest():
    weight = torch.randn(8, 64, generator=GEN)
    q, zeros, scales = feedback_round(weight, torch.eye(64), 32, damp=0.0)
    assert torch.equal(q, round_groups(weight, 32)[0])


def test_sequential_search_leaves_dequantized_weights():
    model = tiny_model("llama")
    ids = torch.randint(0, 1000, (2, 32), generator=GEN)
    state = quantize_model(model, ids, 32, SearchOptions(grid=4, rounding="feedback", sequential=True))
    prefix = "model.layers.1.mlp.up_proj"
    stored = dequantize(state[f"{prefix}.qweight"], state[f"{prefix}.qzeros"], state[f"{prefix}.scales"], 32)
    assert torch.allclose(stored.T, model.model.layers[1].mlp.up_proj.weight, atol=1e-6)


def test_calibration_text_is_disjoint_from_evaluation_text():
    from kvboost_tools.awq.texts import calibration_texts, evaluation_text
    texts = calibration_texts()
    evaluation = evaluation_text()
    assert len(texts) > 500 and not any(text in evaluation for text in texts)   # topics overlap
    assert calibration_texts(3) == texts[:3]


def test_command_line_writes_a_loadable_checkpoint(tmp_path):
    import shutil

    from kvboost_engine.weights.awq.loader import load_awq_model
    from kvboost_tools.awq.quantize import TOKENIZER_FILES, main
    from kvboost_engine.loading import default_model_dir
    source = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(source)
    for name in TOKENIZER_FILES:
        if (default_model_dir() / name).exists():
            shutil.copy(default_model_dir() / name, source / name)
    assert main(["--out", str(tmp_path / "awq"), "--model", str(source), "--rows", "2", "--seq-len", "32",
                 "--grid", "2"]) == 0
    model = load_awq_model(tmp_path / "awq", device=torch.device("cpu"), dtype=torch.float32)
    assert model.kvboost_awq.awq_group_size == 32


def test_command_line_checks_its_output_first_and_fails_in_one_line(tmp_path, capsys, monkeypatch):
    """An --out that is a file failed after the load and the whole calibration (minutes); a bad group
    size or a model not found was a traceback."""
    import pytest
    import kvboost_engine.loading as loading
    from kvboost_tools.awq.quantize import main
    monkeypatch.setattr(loading, "load_model_and_tokenizer", lambda *a, **k: pytest.fail("loaded"))
    afile = tmp_path / "afile"
    afile.write_text("")
    for argv in (["--out", str(afile)], ["--out", str(afile / "below")], ["--out", str(tmp_path / "x"), "--group-size", "48"]):
        with pytest.raises(SystemExit) as refused:
            main(argv)
        assert refused.value.code == 2
    assert main(["--out", str(tmp_path / "x"), "--model", str(tmp_path / "absent")]) == 1
    assert capsys.readouterr().err.strip().endswith(f"kvboost: model path '{tmp_path / 'absent'}' does not exist")
