"""benchmarks/gguf_tokenizer.py: a GGUF with another GGUF's tokenizer (how the random Gemma 3
1B-shape benchmark model gets Gemma's): the source's tokenizer entries replaced by the donor's,
every other entry and every tensor kept byte for byte."""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("gguf.scripts.gguf_new_metadata")

from benchmarks import gguf_tokenizer  # noqa: E402
from gguf_models import Q, write_metadata, write_model  # noqa: E402


def _donor(path) -> list[str]:
    tokens = ["<pad>", "<eos>", "<bos>", "▁a", "▁b"]

    def fill(w):
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores([0.0, 0.0, 0.0, -1.0, -2.0])
        w.add_token_types([3, 3, 3, 1, 1])
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
    write_metadata(path, "gemma3", fill)
    return tokens


def test_tokenizer_replaced_everything_else_kept(tmp_path):
    source, donor, out = tmp_path / "source.gguf", tmp_path / "donor.gguf", tmp_path / "out.gguf"
    write_model(source, "gemma3", Q.Q4_0, embed=Q.Q8_0)
    tokens = _donor(donor)
    gguf_tokenizer.main(str(source), str(donor), str(out))
    before, after = gguf.GGUFReader(str(source)), gguf.GGUFReader(str(out))
    assert after.get_field("tokenizer.ggml.model").contents() == "llama"
    assert after.get_field("tokenizer.ggml.tokens").contents() == tokens
    assert after.get_field("tokenizer.ggml.bos_token_id").contents() == 2
    assert after.get_field("tokenizer.ggml.merges") is None                  # the source's, dropped
    assert after.get_field("tokenizer.chat_template") is None
    kept = [f for f in before.fields if not f.startswith(("tokenizer.", "GGUF."))]
    assert kept and all(after.get_field(f).contents() == before.get_field(f).contents() for f in kept)
    assert [t.name for t in after.tensors] == [t.name for t in before.tensors]
    for a, b in zip(after.tensors, before.tensors):
        assert a.tensor_type == b.tensor_type and np.array_equal(np.asarray(a.data), np.asarray(b.data))


def test_a_donor_without_a_tokenizer_is_refused(tmp_path):
    source, donor = tmp_path / "source.gguf", tmp_path / "donor.gguf"
    write_model(source, "llama", Q.Q4_0)
    write_metadata(donor, "llama")
    with pytest.raises(SystemExit, match="no tokenizer entries"):
        gguf_tokenizer.main(str(source), str(donor), str(tmp_path / "out.gguf"))
    assert not (tmp_path / "out.gguf").exists()
