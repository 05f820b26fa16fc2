"""The disk tier of the KV cache: round trips, budget/LRU, restarts, corruption, threads, write-behind.

No model: random tensors shaped like KV ([2, layers, kv_heads, n, head_dim]).
"""
from __future__ import annotations

import multiprocessing
import os
import shutil
import threading
import time

import pytest
import torch

from kvboost_engine.kv.disk import DiskTier
from kvboost_engine.kv.disk.fileformat import HEADER_SIZE
from kvboost_engine.kv.disk.index import LruBudget
from kvboost_engine.kv.disk.layout import STALE_TEMP_SECONDS
from kvboost_engine.errors import InputError

FP = bytes(range(16))
OTHER_FP = bytes(range(1, 17))
N_TOKENS = 8


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def entry(i: int, dtype=torch.float32, n: int = N_TOKENS):
    """A deterministic entry for key(i): (start, tokens, kv, exact)."""
    gen = torch.Generator().manual_seed(i)
    kv = torch.randn(2, 3, 2, n, 4, generator=gen).to(dtype)
    return 10 * i, tuple(range(i, i + n)), kv, i % 2 == 0


def size_of(i: int = 0) -> int:
    start, tokens, kv, _ = entry(i)
    return HEADER_SIZE + 4 * len(tokens) + kv.numel() * kv.element_size()


def put(tier: DiskTier, i: int, **kw) -> bool:
    return tier.put(key(i), *entry(i, **kw))


def assert_same(got, want):
    assert got is not None
    assert got[0] == want[0] and got[1] == want[1] and got[3] == want[3]
    assert got[2].dtype == want[2].dtype and got[2].shape == want[2].shape
    # bitwise, so NaN payloads or -0.0 could not hide a difference
    assert torch.equal(got[2].view(torch.uint8), want[2].view(torch.uint8))


def files(tier: DiskTier) -> list:
    return sorted(p for p in tier.root.rglob("*") if p.is_file())


@pytest.fixture
def tier(tmp_path):
    with DiskTier(tmp_path, 10 * size_of(), FP) as disk:
        yield disk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip(tmp_path, dtype):
    tier = DiskTier(tmp_path, 1 << 20, FP)
    for i in (1, 2):                         # exact False and True
        assert put(tier, i, dtype=dtype)
        assert_same(tier.get(key(i)), entry(i, dtype=dtype))
    assert tier.get(key(3)) is None
    stats = tier.stats()
    assert (stats["hits"], stats["misses"], stats["writes"], stats["entries"]) == (2, 1, 2, 2)
    assert stats["bytes_written"] == stats["bytes_read"] == stats["bytes_used"] == sum(p.stat().st_size for p in files(tier))


def test_non_contiguous_kv_round_trips(tier):
    start, tokens, kv, exact = entry(1)
    sliced = kv[:, :, :, 2:6]                 # as a cache split produces
    assert tier.put(key(1), start, tokens[2:6], sliced, exact)
    assert torch.equal(tier.get(key(1))[2], sliced)


def test_budget_is_never_exceeded_and_lru_goes_first(tmp_path):
    tier = DiskTier(tmp_path, 3 * size_of(), FP)
    for i in range(3):
        assert put(tier, i)
    assert tier.get(key(0)) is not None      # 0 is now the most recently used
    assert put(tier, 3)
    assert not tier.contains(key(1)) and tier.get(key(1)) is None
    for i in (0, 2, 3):
        assert_same(tier.get(key(i)), entry(i))
    for i in range(4, 12):
        assert put(tier, i)
        on_disk = sum(p.stat().st_size for p in files(tier))
        assert on_disk == tier.stats()["bytes_used"] <= 3 * size_of()
    assert tier.stats()["evictions"] == 9


def test_entry_larger_than_budget_is_refused(tmp_path):
    tier = DiskTier(tmp_path, size_of() - 1, FP)
    assert not put(tier, 1)
    assert not tier.put_async(key(1), *entry(1))
    assert tier.stats()["refused"] == 2 and files(tier) == []
    assert tier.get(key(1)) is None


def test_index_reserve_skips_protected_and_changes_nothing_when_refused():
    index = LruBudget(10)
    index.add(b"a", 4), index.add(b"b", 4)
    assert index.reserve(b"c", 6, protected={b"a", b"b"}) is None
    assert (len(index), index.bytes_used) == (2, 8)
    assert index.reserve(b"c", 6, protected={b"a"}) == [b"b"]
    assert (b"a" in index, b"b" in index, index.bytes_used) == (True, False, 10)
    assert index.reserve(b"a", 5, protected=set()) == [b"c"]     # replacing a key frees its old size
    assert index.bytes_used == 5


def test_restart_sees_old_entries_in_lru_order(tmp_path):
    first = DiskTier(tmp_path, 3 * size_of(), FP)
    for i in range(3):
        put(first, i)
    first.get(key(0))
    first.close()
    second = DiskTier(tmp_path, 3 * size_of(), FP)
    assert second.stats()["entries"] == 3
    assert put(second, 3)                   # evicts 1: the least recently used before the restart
    assert second.get(key(1)) is None
    for i in (0, 2, 3):
        assert_same(second.get(key(i)), entry(i))


def test_restart_with_smaller_budget_trims(tmp_path):
    first = DiskTier(tmp_path, 5 * size_of(), FP)
    for i in range(5):
        put(first, i)
    second = DiskTier(tmp_path, 2 * size_of(), FP)
    assert second.stats()["entries"] == 2 and len(files(second)) == 2
    assert second.get(key(4)) is not None and second.get(key(0)) is None


def test_other_fingerprint_is_ignored_and_left_alone(tmp_path):
    mine = DiskTier(tmp_path, 2 * size_of(), FP)
    put(mine, 1)
    other = DiskTier(tmp_path, 2 * size_of(), OTHER_FP)
    assert other.stats()["entries"] == 0
    assert not other.contains(key(1)) and other.get(key(1)) is None
    for i in range(2, 6):                    # filling the other tier never touches mine
        put(other, i)
    assert_same(mine.get(key(1)), entry(1))


def test_file_of_other_fingerprint_under_my_name_is_not_served(tmp_path):
    mine = DiskTier(tmp_path, 2 * size_of(), FP)
    other = DiskTier(tmp_path, 2 * size_of(), OTHER_FP)
    put(other, 1)
    target = mine._path(key(1))
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(other._path(key(1)), target)
    assert mine.get(key(1)) is None
    assert mine.stats()["corrupt_files_deleted"] == 1 and not target.exists()


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "payload byte": lambda p: _flip(p, p.stat().st_size - 3),
    "token byte": lambda p: _flip(p, HEADER_SIZE + 1),
    "magic": lambda p: _flip(p, 0),
    "start field": lambda p: _flip(p, 48),
    "shape field": lambda p: _flip(p, 88),
    "checksum": lambda p: _flip(p, HEADER_SIZE - 1),
    "truncated payload": lambda p: os.truncate(p, p.stat().st_size - 1),
    "truncated header": lambda p: os.truncate(p, HEADER_SIZE // 2),
    "empty": lambda p: os.truncate(p, 0),
    "extended": lambda p: p.write_bytes(p.read_bytes() + b"\0"),
}


@pytest.mark.parametrize("damage", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_corrupt_file_is_detected_deleted_and_counted(tier, damage):
    put(tier, 1)
    path = tier._path(key(1))
    damage(path)
    assert tier.get(key(1)) is None
    assert not path.exists()
    stats = tier.stats()
    assert (stats["corrupt_files_deleted"], stats["misses"], stats["entries"], stats["bytes_used"]) == (1, 1, 0, 0)
    assert put(tier, 1)                      # recomputed KV goes back and is served
    assert_same(tier.get(key(1)), entry(1))


def test_file_removed_by_another_process_is_a_miss(tmp_path):
    tier = DiskTier(tmp_path, 2 * size_of(), FP)
    for i in (1, 2):
        put(tier, i)
    os.unlink(tier._path(key(1)))
    assert tier.get(key(1)) is None
    assert tier.stats()["corrupt_files_deleted"] == 0 and tier.stats()["entries"] == 1
    os.unlink(tier._path(key(2)))             # evicting a file that is already gone is no error
    assert put(tier, 3) and put(tier, 4)
    assert tier.stats()["entries"] == 2


def test_second_instance_on_same_directory_shares_files(tmp_path):
    """Two tiers on one directory stand in for two processes: each serves the other's files."""
    first = DiskTier(tmp_path, 3 * size_of(), FP)
    second = DiskTier(tmp_path, 3 * size_of(), FP)
    put(first, 1)
    assert second.contains(key(1))
    assert_same(second.get(key(1)), entry(1))
    assert second.stats()["entries"] == 1
    second.delete(key(1))                      # "evicted by the other process"
    assert first.get(key(1)) is None and first.stats()["entries"] == 0


def test_file_over_my_budget_from_a_bigger_tier_is_served_not_accounted(tmp_path):
    big = DiskTier(tmp_path, 3 * size_of(), FP)
    small = DiskTier(tmp_path, size_of() - 1, FP)
    put(big, 1)
    assert_same(small.get(key(1)), entry(1))
    assert small.stats()["bytes_used"] == 0 <= small.stats()["budget_bytes"]


def test_directory_removed_while_running_is_recreated(tmp_path):
    tier = DiskTier(tmp_path / "cache", 3 * size_of(), FP)
    put(tier, 1)
    shutil.rmtree(tmp_path / "cache")
    assert tier.get(key(1)) is None
    assert put(tier, 2)
    assert_same(tier.get(key(2)), entry(2))


def _rewrite_entries(directory, rounds: int) -> None:
    """Child process: write keys 0-3 over and over (each write replaces the last)."""
    tier = DiskTier(directory, 8 * size_of(), FP, fsync=False)
    for step in range(rounds):
        put(tier, step % 4)


def test_another_process_writing_never_shows_a_partial_file(tmp_path):
    reader = DiskTier(tmp_path, 8 * size_of(), FP)
    child = multiprocessing.get_context("fork").Process(target=_rewrite_entries, args=(tmp_path, 200))
    child.start()
    seen = 0
    while child.is_alive() or seen == 0:
        for i in range(4):
            got = reader.get(key(i))
            if got is not None:
                assert_same(got, entry(i))
                seen += 1
    child.join()
    assert child.exitcode == 0 and seen > 0
    assert reader.stats()["corrupt_files_deleted"] == 0


def test_delete(tier):
    put(tier, 1)
    assert tier.delete(key(1))
    assert not tier.contains(key(1)) and tier.get(key(1)) is None and files(tier) == []
    assert not tier.delete(key(1))


def test_concurrent_puts_and_gets(tmp_path):
    tier = DiskTier(tmp_path, 6 * size_of(), FP, fsync=False)
    errors, bad = [], []

    def work(seed: int):
        try:
            for step in range(40):
                i = (seed * 7 + step) % 12       # overlapping keys across threads
                if step % 3:
                    got = tier.get(key(i))
                    if got is not None:
                        bad.extend([] if _same(got, entry(i)) else [i])
                else:
                    put(tier, i)
        except Exception as error:          # noqa: BLE001 - any exception fails the test below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and bad == []
    stats = tier.stats()
    assert stats["bytes_used"] == sum(p.stat().st_size for p in files(tier)) <= 6 * size_of()
    assert stats["hits"] > 0 and stats["corrupt_files_deleted"] == 0


def test_contains_exact_counts_only_an_exact_entry(tmp_path):
    tier = DiskTier(tmp_path, 8 * size_of(), FP, fsync=False)
    start, tokens, kv, _ = entry(1)
    tier.put(key(1), start, tokens, kv, False)
    assert tier.contains(key(1)) and not tier.contains(key(1), exact=True)
    assert not DiskTier(tmp_path, 8 * size_of(), FP).contains(key(1), exact=True)   # another process
    tier.put(key(1), start, tokens, kv, True)                                        # replaced in place
    assert tier.contains(key(1), exact=True) and tier.get(key(1))[3] is True and _accounted(tier)
    tier.put_async(key(2), start, tokens, kv, False)
    assert tier.contains(key(2)) and not tier.contains(key(2), exact=True)
    tier.close()


def _accounted(tier: DiskTier) -> bool:
    return tier.stats()["bytes_used"] == sum(p.stat().st_size for p in files(tier))


def test_a_miss_racing_a_put_of_the_same_key_keeps_it_counted(tier, monkeypatch):
    """get() finds no file, then another thread's put() of that key completes before the miss is
    counted: the fresh file stays in the index (CI saw a file on disk the budget did not count)."""
    import kvboost_engine.kv.disk.tier as tier_module
    real = tier_module.open_regular

    def open_after_a_put(path):
        monkeypatch.setattr(tier_module, "open_regular", real)
        put(tier, 1)                                 # the other thread's whole put
        raise FileNotFoundError(path)

    monkeypatch.setattr(tier_module, "open_regular", open_after_a_put)
    assert tier.get(key(1)) is None
    assert tier.stats()["entries"] == 1 and _accounted(tier)


def test_a_bad_file_replaced_by_a_put_keeps_the_new_one_counted(tier, monkeypatch):
    import kvboost_engine.kv.disk.tier as tier_module
    from kvboost_engine.kv.disk.fileformat import CorruptEntry
    path = tier._path(key(1))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size_of())               # another process's damaged file
    real = tier_module.read_entry

    def read_after_a_put(*args):
        monkeypatch.setattr(tier_module, "read_entry", real)
        put(tier, 1)                                 # renamed over the bad file
        raise CorruptEntry("bad checksum")

    monkeypatch.setattr(tier_module, "read_entry", read_after_a_put)
    assert tier.get(key(1)) is None
    assert tier.stats()["entries"] == 1 and _accounted(tier)
    assert_same(tier.get(key(1)), entry(1))


def test_contains_does_not_count_a_file_evicted_while_it_was_checked(tmp_path, monkeypatch):
    import kvboost_engine.kv.disk.tier as tier_module
    tier = DiskTier(tmp_path, 4 * size_of(), FP, fsync=False)
    other = DiskTier(tmp_path, 4 * size_of(), FP, fsync=False)
    put(other, 1)                                    # another process's file
    real = tier_module.check_header

    def check_then_evicted(fd, *args):
        header = real(fd, *args)
        os.unlink(tier._path(key(1)))                # the other process evicts it
        return header

    monkeypatch.setattr(tier_module, "check_header", check_then_evicted)
    assert tier.contains(key(1))
    assert tier.stats()["entries"] == 0 and _accounted(tier)


def _same(got, want) -> bool:
    return got[:2] == want[:2] and got[3] == want[3] and torch.equal(got[2], want[2])


def test_put_async_serves_from_queue_then_flushes(tmp_path):
    tier = DiskTier(tmp_path, 4 * size_of(), FP)
    writing, gate = threading.Event(), threading.Event()
    write_file = tier._write_file

    def slow_write(*args):
        writing.set()
        gate.wait(10)
        return write_file(*args)

    tier._write_file = slow_write
    for i in (1, 2):
        assert tier.put_async(key(i), *entry(i))
    assert writing.wait(10)                            # 1 is being written, 2 waits in the queue
    for i in (1, 2):
        assert tier.contains(key(i))
        assert_same(tier.get(key(i)), entry(i))        # not on disk yet: served from memory
    assert tier.stats()["queued_hits"] == 2 and tier.stats()["pending_writes"] == 2
    assert not tier.flush(timeout=0.05)
    gate.set()
    assert tier.flush(timeout=10)
    stats = tier.stats()
    assert (stats["writes"], stats["pending_writes"], stats["pending_bytes"]) == (2, 0, 0)
    tier.close()
    reopened = DiskTier(tmp_path, 4 * size_of(), FP)
    for i in (1, 2):
        assert_same(reopened.get(key(i)), entry(i))


def test_put_async_queue_is_bounded_by_bytes(tmp_path):
    tier = DiskTier(tmp_path, 10 * size_of(), FP, max_pending_bytes=size_of())
    gate = threading.Event()
    write_file = tier._write_file
    tier._write_file = lambda *args: gate.wait(10) and write_file(*args)
    assert tier.put_async(key(1), *entry(1))
    assert not tier.put_async(key(2), *entry(2))       # would exceed the queue's bytes: dropped
    assert tier.stats()["dropped_writes"] == 1
    gate.set()
    tier.close()
    assert tier.stats()["writes"] == 1 and not tier.put(key(3), *entry(3))   # closed


def test_no_temp_files_left_and_stale_ones_are_removed(tmp_path):
    tier = DiskTier(tmp_path, 4 * size_of(), FP)
    put(tier, 1)
    assert [p.name for p in files(tier)] == [key(1).hex() + ".kv"]
    folder = tier._path(key(1)).parent
    stale, fresh = folder / ".x.kv.1.2.tmp", folder / ".y.kv.1.2.tmp"
    stale.write_bytes(b"half"), fresh.write_bytes(b"half")
    old = time.time() - STALE_TEMP_SECONDS - 5
    os.utime(stale, (old, old))
    DiskTier(tmp_path, 4 * size_of(), FP)
    assert not stale.exists() and fresh.exists()


def test_bad_input_is_an_error(tier):
    with pytest.raises(InputError):
        tier.get(b"short")
    with pytest.raises(InputError):
        tier.put(key(1), 0, (1, 2), torch.zeros(2, 2, dtype=torch.int64), True)
    with pytest.raises(InputError):
        DiskTier(tier.root, 1, b"x")
