"""The repack cache file (weights/pack_file.py): read into huge pages or mapped, the same tensors
either way, a changed file refused either way, and who decides which."""
from __future__ import annotations

import logging
import mmap

import pytest
import torch

from kvboost_engine.errors import InputError
from kvboost_engine.weights import pack_file
from kvboost_engine.weights.pack_file import PackWriter, huge_pages, read_pack

TENSORS = {
    "codes": torch.arange(3 * 1000, dtype=torch.int32).to(torch.uint8).view(3, 1000),
    "d": torch.linspace(-1, 1, 96, dtype=torch.float32).to(torch.bfloat16).view(6, 16),
    "norm": torch.randn(33, generator=torch.Generator().manual_seed(0)),
    "nothing": torch.empty(0, 4, dtype=torch.float16),
}


def write(tmp_path):
    data, index = tmp_path / "w.bin", tmp_path / "w.json"
    writer = PackWriter(data, index)
    for name, tensor in TENSORS.items():
        writer.add(name, tensor)
    writer.finish({"note": "test"})
    return data, index


@pytest.mark.parametrize("huge", [True, False])
def test_both_placements_give_the_written_tensors(tmp_path, huge):
    data, index = write(tmp_path)
    pack = read_pack(data, index, huge)
    assert pack.placement == ("huge_pages" if huge else "mapped")
    assert pack.meta == {"note": "test"}
    start, end = pack.span
    assert end - start == data.stat().st_size
    for name, want in TENSORS.items():
        got = pack.tensors[name]
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        if got.numel():
            assert start <= got.data_ptr() < end         # views of the one buffer, not copies
    before = data.read_bytes()
    pack.tensors["norm"][0] = 123.0                      # private either way: the file is untouched
    assert data.read_bytes() == before


@pytest.mark.parametrize("huge", [True, False])
def test_a_changed_file_is_refused(tmp_path, huge):
    data, index = write(tmp_path)
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF                                     # same size, one byte differs
    data.write_bytes(bytes(raw))
    with pytest.raises(InputError, match="checksum"):
        read_pack(data, index, huge)


def test_who_decides(tmp_path, monkeypatch):
    setting = tmp_path / "enabled"
    monkeypatch.setattr(pack_file, "THP_SETTING", setting)
    monkeypatch.delenv(pack_file.HUGE_PAGES_ENV, raising=False)
    setting.write_text("always [madvise] never\n")
    assert pack_file.thp_setting() == "madvise" and huge_pages() == hasattr(mmap, "MADV_HUGEPAGE")
    setting.write_text("always madvise [never]\n")
    assert not huge_pages()
    monkeypatch.setenv(pack_file.HUGE_PAGES_ENV, "1")
    assert huge_pages()                                  # the environment decides over the kernel's setting
    setting.write_text("[always] madvise never\n")
    monkeypatch.setenv(pack_file.HUGE_PAGES_ENV, "0")
    assert not huge_pages()
    setting.unlink()                                     # unreadable: no huge pages unless asked
    monkeypatch.delenv(pack_file.HUGE_PAGES_ENV)
    assert pack_file.thp_setting() == "" and not huge_pages()
    data, index = write(tmp_path)
    assert read_pack(data, index).placement == "mapped"


def test_no_memory_for_the_copy_maps_the_file(tmp_path, monkeypatch, caplog):
    data, index = write(tmp_path)

    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(pack_file, "_read_into_huge_pages", refuse)
    with caplog.at_level(logging.WARNING, logger=pack_file.__name__):
        pack = read_pack(data, index, True)
    assert pack.placement == "mapped" and torch.equal(pack.tensors["norm"], TENSORS["norm"])
    assert "mapping it" in caplog.text
