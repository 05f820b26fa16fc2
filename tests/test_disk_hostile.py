"""A damaged or hostile disk tier directory: FIFOs, device links, links out of the directory, a
sparse 50 GB file, a read-only directory, temp files of dead writers.

Each case warms a directory with one engine (a tiny model), damages it, and starts another
engine on it: nothing hangs, junk costs only itself, and the engine answers exactly like a
cache_bytes=0 engine.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvboost_engine import Engine
from kvboost_engine.kv.disk import DiskTier
from kvboost_engine.kv.disk.layout import FOREIGN_TEMP_SECONDS, HOST_TAG, STALE_TEMP_SECONDS, writable
from tiny_models import tiny_model

MESSAGES = [{"role": "system", "content": "You are terse and exact. " * 12},
            {"role": "user", "content": "Name one colour of the sea."}]
FP = bytes(range(16))


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoTokenizer
    from kvboost_engine.loading import default_model_dir
    return tiny_model("llama", max_position_embeddings=512), AutoTokenizer.from_pretrained(default_model_dir())


@pytest.fixture(scope="module")
def cold_tokens(tiny):
    return Engine(*tiny, cache_bytes=0).chat(MESSAGES, max_new_tokens=6).token_ids


def warm(tiny, directory: Path) -> list[Path]:
    """Fill `directory` with the entries of MESSAGES; returns the entry files."""
    with Engine(*tiny, disk_cache_dir=str(directory)) as engine:
        engine.chat(MESSAGES, max_new_tokens=6)
        root = engine.disk.root
    files = sorted(root.rglob("*.kv"))
    assert len(files) >= 3
    return files


def answer(engine: Engine, timeout: float = 120):
    """engine.chat(MESSAGES) in a thread: fails (instead of hanging the suite) if it does not return."""
    out = {}
    worker = threading.Thread(target=lambda: out.update(gen=engine.chat(MESSAGES, max_new_tokens=6)), daemon=True)
    worker.start()
    worker.join(timeout)
    assert not worker.is_alive(), "the request hung on the cache directory"
    return out["gen"]


def assert_answers_like_cold(engine: Engine, cold_tokens, *, restored: bool | None = None):
    """Greedy tokens equal the no-cache engine's; `restored`: whether KV came from the disk."""
    gen = answer(engine)
    assert gen.token_ids == cold_tokens
    if restored is not None:
        assert (engine.stats()["disk_hits"] > 0) == restored


def test_fifos_at_entry_names_never_block(tiny, cold_tokens, tmp_path):
    files = warm(tiny, tmp_path)
    engine = Engine(*tiny, disk_cache_dir=str(tmp_path))        # indexed the regular files
    for path in files:                                          # now every entry is a FIFO
        path.unlink()
        os.mkfifo(path)
    assert_answers_like_cold(engine, cold_tokens, restored=False)
    assert engine.stats()["disk_corrupt_files_deleted"] >= 1   # the ones looked up, or checked before writing
    engine.close()
    fifos = [p for p in files if p.is_fifo()]
    again = Engine(*tiny, disk_cache_dir=str(tmp_path))         # the start-up scan removes the rest
    assert not any(p.is_fifo() for p in files)
    assert again.stats()["disk_corrupt_files_deleted"] == len(fifos)
    assert_answers_like_cold(again, cold_tokens, restored=True)


def test_device_links_and_links_out_of_the_directory_are_never_followed(tiny, cold_tokens, tmp_path):
    files = warm(tiny, tmp_path / "cache")
    outside = tmp_path / "outside"
    outside.mkdir()
    engine = Engine(*tiny, disk_cache_dir=str(tmp_path / "cache"))
    for index, path in enumerate(files):
        target = outside / path.name
        shutil.move(path, target)                               # a valid entry, but out of the directory
        path.symlink_to("/dev/zero" if index == 0 else target)
    assert_answers_like_cold(engine, cold_tokens, restored=False)
    engine.close()
    again = Engine(*tiny, disk_cache_dir=str(tmp_path / "cache"))   # the start-up scan removes the rest
    assert not any(p.is_symlink() for p in files)               # the links went, their targets stayed
    assert all((outside / p.name).is_file() for p in files)
    assert_answers_like_cold(again, cold_tokens)


def test_a_symlinked_fan_out_folder_is_not_followed(tiny, cold_tokens, tmp_path):
    files = warm(tiny, tmp_path / "cache")
    folder = files[0].parent
    moved = tmp_path / "elsewhere"
    shutil.move(folder, moved)
    folder.symlink_to(moved, target_is_directory=True)
    listing = sorted(p.name for p in moved.iterdir())
    engine = Engine(*tiny, disk_cache_dir=str(tmp_path / "cache"))
    assert_answers_like_cold(engine, cold_tokens)
    engine.close()
    assert sorted(p.name for p in moved.iterdir()) == listing   # nothing read, written or deleted there


@pytest.mark.parametrize("size", [50 * 2**30, 2**20], ids=["sparse 50 GB", "1 MB of zeros"])
def test_a_junk_file_costs_only_itself_at_start(tiny, cold_tokens, tmp_path, size):
    files = warm(tiny, tmp_path)
    junk = files[0].parent / ("ab" * 16 + ".kv")
    with open(junk, "wb") as handle:
        handle.truncate(size)                                   # sparse: no disk used
    os.utime(junk, (1, 1))                                      # the oldest: first in LRU order
    engine = Engine(*tiny, disk_cache_dir=str(tmp_path), disk_cache_bytes=4 * 2**30)
    stats = engine.stats()
    assert not junk.exists() and stats["disk_corrupt_files_deleted"] == 1
    assert stats["disk_entries"] == len(files) and all(p.is_file() for p in files)
    assert_answers_like_cold(engine, cold_tokens, restored=True)


def test_a_sparse_file_appearing_later_is_a_miss_not_a_read(tiny, cold_tokens, tmp_path):
    files = warm(tiny, tmp_path)
    engine = Engine(*tiny, disk_cache_dir=str(tmp_path))
    for path in files:
        os.truncate(path, 50 * 2**30)                           # header intact, size wrong: never read
    assert_answers_like_cold(engine, cold_tokens, restored=False)
    assert engine.stats()["disk_bytes_read"] == 0


@pytest.fixture
def read_only(monkeypatch):
    """Make folders read-only: chmod, and where that does not bind (root), refuse writes under them
    the way a read-only mount does (EROFS from every call that would change the directory)."""
    folders: list[str] = []

    def protect(folder: Path) -> None:
        for path in [folder, *folder.rglob("*")]:
            if path.is_dir():
                path.chmod(0o555)
        folders.append(os.path.abspath(folder))
        if writable(folder):                                    # root: permission bits do not bind
            _refuse_writes(monkeypatch, folders)

    yield protect
    for folder in folders:
        for path in [Path(folder), *Path(folder).rglob("*")]:
            if path.is_dir():
                path.chmod(0o755)


def _refuse_writes(monkeypatch, folders: list[str]) -> None:
    def inside(path) -> bool:
        return isinstance(path, (str, os.PathLike)) and any(
            os.path.abspath(os.fspath(path)).startswith(f) for f in folders)

    def guard(name: str, writes=lambda args, kwargs: True):
        real = getattr(os, name)

        def call(*args, **kwargs):
            if writes(args, kwargs) and any(inside(a) for a in args[:2]):
                raise OSError(errno.EROFS, "Read-only file system", os.fspath(args[0]))
            return real(*args, **kwargs)
        monkeypatch.setattr(os, name, call)

    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC
    guard("open", lambda args, kwargs: bool((args[1] if len(args) > 1 else kwargs.get("flags", 0)) & writing))
    for name in ("mkdir", "unlink", "remove", "rename", "replace", "utime", "rmdir"):
        guard(name)


def test_a_read_only_prewarmed_directory_is_served_without_writes(tiny, cold_tokens, tmp_path, read_only, caplog):
    files = warm(tiny, tmp_path / "cache")
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("*")}
    read_only(tmp_path / "cache")
    with caplog.at_level(logging.WARNING):
        engine = Engine(*tiny, disk_cache_dir=str(tmp_path / "cache"))
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("not writable: serving its entries read-only" in w for w in warnings) == 1
    assert any("read-only: the KV spill file goes to" in w for w in warnings)
    assert engine.cache.pool.spill is not None                  # spilling still works, elsewhere
    assert engine.stats()["disk_read_only"] and engine.stats()["disk_entries"] == len(files)
    assert_answers_like_cold(engine, cold_tokens, restored=True)
    engine.chat([{"role": "user", "content": "Something new to store."}], max_new_tokens=4)
    engine.close()
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("*")} == before
    assert engine.stats()["disk_writes"] == 0


def test_a_read_only_directory_without_this_models_folder_still_starts(tiny, cold_tokens, tmp_path, read_only):
    (tmp_path / "cache").mkdir()
    read_only(tmp_path / "cache")
    engine = Engine(*tiny, disk_cache_dir=str(tmp_path / "cache"))
    assert engine.stats()["disk_read_only"] and engine.stats()["disk_entries"] == 0
    assert_answers_like_cold(engine, cold_tokens, restored=False)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_temps_of_dead_writers_are_removed_at_start(tiny, cold_tokens, tmp_path):
    files = warm(tiny, tmp_path)
    folder = files[0].parent
    name = files[0].name
    old = time.time() - FOREIGN_TEMP_SECONDS - 5
    temps = {
        "dead writer, fresh": (f".{name}.{HOST_TAG}-{_dead_pid()}.1.tmp", None, False),
        "live writer, fresh": (f".{name}.{HOST_TAG}-{os.getpid()}.1.tmp", None, True),
        "live writer, older than the pid could live": (f".{name}.{HOST_TAG}-{os.getpid()}.2.tmp",
                                                       time.time() - STALE_TEMP_SECONDS - 5, False),
        "other host, fresh": (f".{name}.00000000-1.1.tmp", None, True),
        "other host, old": (f".{name}.00000000-1.2.tmp", old, False),
        "old name format, old": (f".{name}.1.2.tmp", old, False),
    }
    for temp, mtime, _ in temps.values():
        (folder / temp).write_bytes(b"half an entry")
        if mtime is not None:
            os.utime(folder / temp, (mtime, mtime))
    engine = Engine(*tiny, disk_cache_dir=str(tmp_path))
    kept = {label for label, (temp, _, _) in temps.items() if (folder / temp).exists()}
    assert kept == {label for label, (_, _, keep) in temps.items() if keep}
    assert engine.stats()["disk_stale_temps_removed"] == len(temps) - len(kept)
    assert_answers_like_cold(engine, cold_tokens, restored=True)


def test_tier_level_fifo_get_and_contains_return_at_once(tmp_path):
    import torch
    tier = DiskTier(tmp_path, 1 << 20, FP)
    key = bytes(range(1, 17))
    path = tier._path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    assert not tier.contains(key) and not path.exists()        # a FIFO is junk: removed
    os.mkfifo(path)
    assert tier.get(key) is None and not path.exists()
    kv = torch.zeros(2, 1, 1, 4, 2)
    assert tier.put(key, 0, (1, 2, 3, 4), kv, True) and tier.get(key)[1] == (1, 2, 3, 4)


class _SmallDisk:
    """A file system of `capacity` bytes under the tier's folder: statvfs reports what is left and
    writes past it fail with ENOSPC; or (`report` False) a quota statvfs does not see, failing with
    EDQUOT; or (`inodes` False) no inode left: ENOSPC whatever the bytes statvfs reports."""

    def __init__(self, monkeypatch, root: Path, capacity: int, report: bool = True, inodes: bool = True,
                 max_files: int = 0):
        import kvboost_engine.kv.disk.tier as tier_module
        self.root, self.capacity = root, capacity
        real_write, real_statvfs = tier_module.write_entry, os.statvfs

        def write_entry(fd, fingerprint, key, start, tokens, kv, exact):
            if (not inodes or self.used() + kv.numel() * kv.element_size() > capacity
                    or max_files and self.inodes() > max_files):
                code = errno.EDQUOT if report is False and inodes else errno.ENOSPC
                raise OSError(code, os.strerror(code))
            real_write(fd, fingerprint, key, start, tokens, kv, exact)

        def statvfs(path):
            real = real_statvfs(path)
            if not report or not str(path).startswith(str(root)):
                return real
            free = (capacity - self.used()) // 4096
            files = max(0, max_files - self.inodes())
            return os.statvfs_result((4096, 4096, capacity // 4096, free, free, max_files, files, files, 0, 255))
        monkeypatch.setattr(tier_module, "write_entry", write_entry)
        monkeypatch.setattr(os, "statvfs", statvfs)

    def used(self) -> int:
        return sum(p.stat().st_size for p in self.root.rglob("*.kv"))

    def inodes(self) -> int:
        return len(list(self.root.rglob("*")))          # entries, temps and fan-out folders


@pytest.mark.parametrize("seen_by_statvfs", [True, False], ids=["smaller-partition", "quota"])
def test_a_disk_fuller_than_the_budget_evicts_old_entries_instead_of_refusing_new_ones(tmp_path, monkeypatch,
                                                                                     seen_by_statvfs):
    """A budget larger than the room the disk has (8 GiB by default on a small partition, a quota,
    other files filling it): the tier gives up its oldest entries as the budget would, instead of
    failing every later write and keeping only the first entries for good."""
    import torch
    tier = DiskTier(tmp_path, 1 << 30, FP, fsync=False)
    disk = _SmallDisk(monkeypatch, tier.root, capacity=1 << 20, report=seen_by_statvfs)
    keys = [i.to_bytes(16, "big") for i in range(12)]
    try:
        for i, key in enumerate(keys):
            assert tier.put(key, 0, (1, 2, 3), torch.full((48_000,), float(i)), True)
        assert disk.used() <= disk.capacity
        for i, key in enumerate(keys[-3:], start=9):
            assert tier.get(key)[2][0].item() == i        # the newest are there, exact
        stats = tier.stats()
        assert stats["write_errors"] == 0 and stats["evictions"] >= 6 and stats["entries"] <= 5
        assert (stats["no_room"] > 0) == (not seen_by_statvfs)   # statvfs seen: no write fails at all
    finally:
        tier.close()


def test_kv_another_kernel_computed_is_never_served_from_disk(tiny, tmp_path):
    """The native step and the PyTorch path (or two instruction-set variants) compute KV that
    differs in the last bits: a folder shared by settings or machines keeps each one's entries
    apart, so reuse stays exact for both; the same settings find their own entries again."""
    torch_kv = warm_root(tiny, tmp_path, native_decode=False)
    with Engine(*tiny, disk_cache_dir=str(tmp_path)) as native:
        if not native.stats()["native_decode"]:
            pytest.skip("the native step does not run here")
        assert native.disk.root != torch_kv
        gen = native.chat(MESSAGES, max_new_tokens=6)
        assert native.stats()["disk_hits"] == 0 and gen.reused_tokens == 0
    with Engine(*tiny, disk_cache_dir=str(tmp_path), native_decode=False) as again:
        assert again.disk.root == torch_kv
        again.chat(MESSAGES, max_new_tokens=6)
        assert again.stats()["disk_hits"] > 0


def warm_root(tiny, directory: Path, **options) -> Path:
    with Engine(*tiny, disk_cache_dir=str(directory), **options) as engine:
        engine.chat(MESSAGES, max_new_tokens=6)
        return engine.disk.root


def test_enospc_that_entries_would_not_buy_keeps_them(tmp_path, monkeypatch):
    """ENOSPC with bytes and inodes free (a file system's own metadata full): evicting entries buys no
    write, so none goes (the first version of the eviction emptied the tier one entry per refused put)."""
    import torch
    tier = DiskTier(tmp_path, 1 << 30, FP, fsync=False)
    try:
        for i in range(4):
            assert tier.put(i.to_bytes(16, "big"), 0, (1, 2, 3), torch.full((1000,), float(i)), True)
        _SmallDisk(monkeypatch, tier.root, capacity=1 << 30, inodes=False)
        for i in range(4, 10):
            assert not tier.put(i.to_bytes(16, "big"), 0, (1, 2, 3), torch.full((1000,), float(i)), True)
        stats = tier.stats()
        assert (stats["entries"], stats["evictions"], stats["no_room"], stats["write_errors"]) == (4, 0, 0, 6)
    finally:
        tier.close()


def test_a_budget_near_the_disk_size_evicts_one_entry_per_entry_written(tmp_path, monkeypatch):
    """The free-room check runs after the budget's own victims are gone: it counted their bytes as
    missing and evicted a second entry every other put."""
    import torch
    size = 4096 * 2 + 1024                                 # payload bytes of one entry, about 9 KB
    from kvboost_engine.kv.disk.fileformat import entry_size
    one = entry_size(3, torch.zeros(size // 4))
    tier = DiskTier(tmp_path, 5 * one, FP, fsync=False)
    disk = _SmallDisk(monkeypatch, tier.root, capacity=6 * one + (64 << 10))
    try:
        for i in range(12):
            assert tier.put(i.to_bytes(16, "big"), 0, (1, 2, 3), torch.full((size // 4,), float(i)), True)
            assert tier.stats()["evictions"] == max(0, i - 4)
        assert disk.used() <= disk.capacity
    finally:
        tier.close()


def test_inodes_the_tier_holds_itself_are_traded_as_bytes_are(tmp_path, monkeypatch):
    """A file system out of inodes, held by the tier's own files: it evicts its oldest entry (and one
    more where the fan-out folder is new) and keeps writing; it stopped at the 11th entry for good."""
    import torch
    tier = DiskTier(tmp_path, 1 << 30, FP, fsync=False)
    _SmallDisk(monkeypatch, tier.root, capacity=1 << 30, max_files=12)
    keys = [i.to_bytes(16, "big") for i in range(30)]            # one fan-out folder ("00")
    try:
        for i, key in enumerate(keys):
            assert tier.put(key, 0, (1, 2, 3), torch.full((100,), float(i)), True)
        assert tier.get(keys[-1])[2][0].item() == 29
        stats = tier.stats()
        assert stats["write_errors"] == 0 and stats["entries"] == 11 and stats["evictions"] == 19
    finally:
        tier.close()
