"""DiskTier: KV entries as checksummed files in a directory, under a byte budget, LRU evicted."""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import asdict
from pathlib import Path

import torch

from ...errors import InputError
from .fileformat import CorruptEntry, check_header, check_payload, entry_size, read_entry, write_entry
from .index import DiskStats, LruBudget
from .layout import (KEY_BYTES, NotRegularFile, check_key, disk_shortfall, entry_path, open_regular,
                     prepare_root, room_lacking, stamp, still_names, tier_root, unlink, unlink_entry,
                     write_atomically)
from .scan import scan
from .writer import WriteBehind

log = logging.getLogger(__name__)


class DiskTier:
    """KV entries on local disk, keyed by 16-byte prefix keys; thread-safe, multi-process safe.

    Files are written to a temporary name, fsynced and renamed, so no reader (thread or
    process) ever sees a partial file; every read verifies header and checksum, and a bad
    file is deleted and reported as a miss. Recency lives in memory and in file mtimes, so a
    restart resumes the LRU order. The budget is exact for one tier; tiers sharing a directory
    (engines, processes) each enforce it over the files they know of (found at start, written or read).
    Files of other fingerprints live in other subdirectories (layout.py) and are never read,
    counted or deleted: another model may be using them.

    Only regular files are opened, without blocking (layout.open_regular); the start-up scan
    checks every file's header, so junk costs only itself (scan.py). A directory that cannot be
    written (a read-only, pre-warmed cache) is served read-only: entries are read, nothing is
    written, stamped or deleted (one warning; `read_only` in stats).
    """

    def __init__(self, directory, budget_bytes: int, fingerprint: bytes, *,
                 max_pending_bytes: int = 256 << 20, fsync: bool = True):
        if len(fingerprint) != KEY_BYTES:
            raise InputError(f"fingerprint must be {KEY_BYTES} bytes, got {len(fingerprint)}")
        if budget_bytes < 0 or max_pending_bytes < 0:
            raise InputError(f"disk budgets must be >= 0 (budget_bytes={budget_bytes}, "
                             f"max_pending_bytes={max_pending_bytes})")
        self.fingerprint = fingerprint
        self.root = tier_root(directory, fingerprint)
        try:
            self.read_only = not prepare_root(self.root)
        except NotADirectoryError as error:
            raise InputError(str(error)) from None
        if self.read_only:
            log.warning("kvboost disk tier: %s is not writable: serving its entries read-only (nothing new is "
                        "written)", directory)
        self.fsync = fsync
        self._index = LruBudget(budget_bytes)
        self._unreadable: set[bytes] = set()       # read-only: bad files that cannot be deleted
        self._writing: set[bytes] = set()          # keys whose file is being written now
        self._lock = threading.Lock()
        self._counters = DiskStats()
        self._writer = WriteBehind(self.put, max_pending_bytes)
        self._closed = False
        self._scan()

    # ---- writing ------------------------------------------------------------------------
    def put(self, key: bytes, start: int, tokens: tuple, kv: torch.Tensor, exact: bool) -> bool:
        """Write one entry now, evicting least recently used files to fit the budget.

        Returns False (writing nothing) when the entry is larger than the whole budget, the
        rest cannot be evicted, the tier is closed, or the write fails (logged). An existing
        file of the same key is replaced atomically.
        """
        check_key(key)
        kv = check_payload(tokens, kv)
        size = entry_size(len(tokens), kv)
        with self._lock:
            if self._closed or self.read_only:
                return False
            if key in self._writing:
                return True                         # same key, so the same KV, on its way
            before = self._index.size(key)          # the file this one replaces, if any
            victims = self._index.reserve(key, size, self._writing)
            if victims is None:
                self._counters.refused += 1
                return False
            self._writing.add(key)
            self._unlink_evicted(victims)           # then what the disk itself lacks (statvfs after those went)
            self._unlink_evicted(self._index.drop_oldest(disk_shortfall(self.root, size), self._writing))
        written = self._write_file(key, start, tokens, kv, exact, size)
        with self._lock:
            self._writing.discard(key)
            if written and key not in self._index:  # deleted while it was being written
                unlink(self._path(key))
            elif written:
                self._counters.writes += 1
                self._counters.bytes_written += size
            else:                                   # a file it was to replace stays, and counted
                self._index.remove(key)
                if before is not None and os.path.lexists(self._path(key)):
                    self._index.add(key, before)
                    self._unlink_evicted(self._index.trim(self._writing | {key}))
                self._counters.write_errors += 1
        return written

    def put_async(self, key: bytes, start: int, tokens: tuple, kv: torch.Tensor, exact: bool) -> bool:
        """Queue `put` on the background writer; never waits for disk. False when the entry
        can never fit the budget or the queue's byte bound is reached (dropped, counted).
        Until its file is in place, `get` serves a queued entry from memory, so the caller
        must not modify `kv` afterwards."""
        check_key(key)
        kv = check_payload(tokens, kv)
        size = entry_size(len(tokens), kv)
        with self._lock:
            if self._closed or self.read_only:
                return False
            if size > self._index.budget_bytes:
                self._counters.refused += 1
                return False
        if self._writer.submit(key, (start, tuple(tokens), kv, exact), size, lambda queued: exact and not queued[3]):
            return True
        with self._lock:
            self._counters.dropped_writes += 1
        return False

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is on disk; False if `timeout` ran out first."""
        return self._writer.flush(timeout)

    def close(self) -> None:
        """Finish queued writes and stop the writer; later puts return False, gets still work."""
        self._writer.close()
        with self._lock:
            self._closed = True

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- reading ------------------------------------------------------------------------
    def get(self, key: bytes) -> tuple[int, tuple[int, ...], torch.Tensor, bool] | None:
        """(start, tokens, kv, exact) of `key`, or None. A corrupt, truncated or foreign file
        is deleted and counted, never served; a file removed meanwhile is a plain miss."""
        check_key(key)
        queued = self._writer.lookup(key)
        if queued is not None:
            with self._lock:
                self._counters.hits += 1
                self._counters.queued_hits += 1
            return queued
        path = self._path(key)
        if key in self._unreadable:
            with self._lock:
                self._counters.misses += 1
            return None
        try:
            fd, info = open_regular(path)
        except NotRegularFile as error:
            self._discard(key, path, error)
            return None
        except OSError as error:
            self._count_miss(key, error)
            return None
        try:
            return self._read_open(key, path, fd, info)
        finally:
            os.close(fd)

    def _read_open(self, key: bytes, path: Path, fd: int, info: os.stat_result):
        try:
            entry = read_entry(fd, info.st_size, self.fingerprint, key)
        except CorruptEntry as error:
            self._discard(key, path, error, fd)
            return None
        except OSError as error:
            self._count_miss(key, error)
            return None
        with self._lock:
            self._counters.hits += 1
            self._counters.bytes_read += info.st_size
            if key in self._index:
                self._index.touch(key)
            elif key not in self._writing and os.fstat(fd).st_nlink:   # another process wrote it
                self._adopt(key, info.st_size)
        if not self.read_only:
            stamp(path)
        return entry.start, entry.tokens, entry.kv, entry.exact

    def contains(self, key: bytes, exact: bool = False) -> bool:
        """Whether `key` is queued or on disk (a file written by another process counts). `exact`:
        only an entry stored as exact counts (an engine's exact KV replaces an approximate one)."""
        check_key(key)
        queued = self._writer.lookup(key)
        if queued is not None:
            return queued[3] or not exact
        with self._lock:
            if key in self._index and not exact:
                return True
        path = self._path(key)
        if key in self._unreadable:
            return False
        try:
            fd, info = open_regular(path)
        except NotRegularFile as error:
            self._discard(key, path, error, count_miss=False)
            return False
        except OSError:
            return False
        try:
            fields = check_header(fd, info.st_size, self.fingerprint, key)[1]
        except (CorruptEntry, OSError) as error:
            self._discard(key, path, error, fd, count_miss=False)
            return False
        else:
            with self._lock:                        # st_nlink 0: evicted since it was opened
                if key not in self._index and key not in self._writing and os.fstat(fd).st_nlink:
                    self._adopt(key, info.st_size)
        finally:
            os.close(fd)
        return bool(fields[4]) or not exact

    def delete(self, key: bytes) -> bool:
        """Remove `key` (queued write or file); True if there was something to remove."""
        check_key(key)
        cancelled = self._writer.cancel(key)
        with self._lock:
            known = self._index.remove(key) is not None
            return (not self.read_only and unlink(self._path(key))) or known or cancelled

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self._index), "bytes_used": self._index.bytes_used,
                    "budget_bytes": self._index.budget_bytes, "read_only": self.read_only, **asdict(self._counters),
                    "pending_writes": len(self._writer), "pending_bytes": self._writer.pending_bytes}

    # ---- internals ----------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        return entry_path(self.root, key)

    def _write_file(self, key: bytes, start: int, tokens, kv: torch.Tensor, exact: bool, size: int) -> bool:
        """Write the entry's file. A disk that fills up below the budget (ENOSPC, EDQUOT: other
        files, a smaller partition) costs least recently used entries, once, as the budget would."""
        def write(fd: int) -> None:
            write_entry(fd, self.fingerprint, key, start, tokens, kv, exact)
        error = write_atomically(self._path(key), write, self.fsync)
        lacking, files = room_lacking(error, self._path(key), size) if error is not None else (0, 0)
        if lacking or files:
            with self._lock:
                self._counters.no_room += 1
                self._unlink_evicted(self._index.drop_oldest(lacking, self._writing | {key}, files))
            error = write_atomically(self._path(key), write, self.fsync)
        if error is not None:
            log.warning("kvboost disk tier: could not write %s: %s", self._path(key), error)
        return error is None

    def _count_miss(self, key: bytes, error: OSError) -> None:
        with self._lock:
            self._counters.misses += 1
            if isinstance(error, FileNotFoundError):
                # evicted by another process; not if a put of this process wrote it meanwhile
                if key not in self._writing and not os.path.lexists(self._path(key)):
                    self._index.remove(key)
            else:
                self._counters.read_errors += 1
                log.warning("kvboost disk tier: could not read %s: %s", self._path(key), error)

    def _discard(self, key: bytes, path: Path, error: OSError | CorruptEntry, fd: int | None = None,
                 count_miss: bool = True) -> None:
        """A file that must not be served (corrupt, foreign, not a regular file): a miss; deleted
        unless the tier is read-only or the name now holds another (fresh) file."""
        log.warning("kvboost disk tier: %s entry %s: %s", "skipping" if self.read_only else "deleting", path, error)
        with self._lock:
            self._counters.misses += count_miss
            if key in self._writing:
                return
            if self.read_only:
                self._index.remove(key)
                self._unreadable.add(key)
            elif still_names(path, fd):
                self._index.remove(key)
                self._counters.corrupt_files_deleted += unlink(path)
            elif not os.path.lexists(path):          # a fresh file there stays counted
                self._index.remove(key)

    def _adopt(self, key: bytes, size: int) -> None:
        """Account a file another process wrote; evicts older ones if it breaks the budget.
        A file larger than this tier's whole budget (another process may have a larger one)
        is served but not accounted, so it is never evicted from here."""
        if size > self._index.budget_bytes:
            return
        self._index.add(key, size)
        if not self.read_only:
            self._unlink_evicted(self._index.trim(self._writing | {key}))

    def _unlink_evicted(self, victims: list[bytes]) -> None:
        for victim in victims:
            unlink_entry(self._path(victim))
            self._counters.evictions += 1

    def _scan(self) -> None:
        """Index the valid files already there (oldest first), fit them to the budget, and delete
        junk (names that are not regular files, bad headers) and temps of dead writers."""
        found = scan(self.root, self.fingerprint, self._index.budget_bytes, clean_temps=not self.read_only)
        for key, size in found.entries:
            self._index.add(key, size)
        self._counters.stale_temps_removed += found.stale_temps_removed
        if found.junk:
            log.warning("kvboost disk tier: %d files in %s are not valid entries (not regular files, bad headers "
                        "or sizes)%s", len(found.junk), self.root, "" if self.read_only else ": deleted")
        for path in found.junk:
            if self.read_only:
                self._unreadable.add(bytes.fromhex(path.name[:2 * KEY_BYTES]))
            elif unlink(path):
                self._counters.corrupt_files_deleted += 1
        if not self.read_only:
            self._unlink_evicted(self._index.trim(set()))

