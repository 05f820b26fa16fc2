"""The start-up scan of a tier's directory: which entries are there, which names are junk.

Every entry-named file is checked before it is counted: it must be a regular file (not a FIFO,
a device or a symlink) whose header names this tier's fingerprint and key and whose size is
exactly what the header describes. Anything else is junk for that file alone, so one bogus
file (say a sparse 50 GB one) can never push the valid entries out of the budget. Nothing is
read past a header, and nothing here blocks.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from .fileformat import CorruptEntry, check_header
from .layout import NotRegularFile, key_of, open_regular, temp_is_stale, unlink


@dataclass(slots=True)
class ScanResult:
    entries: list[tuple[bytes, int]] = field(default_factory=list)   # (key, size), oldest first
    junk: list[Path] = field(default_factory=list)          # entry names never to serve
    oversized: int = 0          # valid entries larger than this tier's budget: served, not counted
    stale_temps_removed: int = 0


def scan(root: Path, fingerprint: bytes, budget_bytes: int, *, clean_temps: bool) -> ScanResult:
    """Check every entry file under `root` (see the module doc); with `clean_temps`, remove temp
    files their writers left behind (layout.temp_is_stale)."""
    result, found, now = ScanResult(), [], time.time()
    try:
        folders = [d for d in os.scandir(root) if d.is_dir(follow_symlinks=False) and len(d.name) == 2]
    except OSError:
        return result                       # no directory (yet): nothing to index
    for folder in folders:
        try:
            items = list(os.scandir(folder.path))
        except OSError:
            continue
        for item in items:
            _visit(item, fingerprint, budget_bytes, clean_temps, now, found, result)
    result.entries = [(key, size) for _, key, size in sorted(found)]
    return result


def _visit(item: os.DirEntry, fingerprint: bytes, budget_bytes: int, clean_temps: bool, now: float,
           found: list, result: ScanResult) -> None:
    key = key_of(item.name)
    path = Path(item.path)
    if key is None:
        if clean_temps and item.name.endswith(".tmp") and _is_stale_temp(item, now):
            result.stale_temps_removed += unlink(path)
        return
    try:
        fd, info = open_regular(path)
    except NotRegularFile:                  # a FIFO, a device, a symlink: never read
        result.junk.append(path)
        return
    except OSError:                         # removed meanwhile, or unreadable: left alone
        return
    try:
        check_header(fd, info.st_size, fingerprint, key)
    except (CorruptEntry, OSError):
        result.junk.append(path)
        return
    finally:
        os.close(fd)
    if info.st_size > budget_bytes:
        result.oversized += 1
    else:
        found.append((info.st_mtime_ns, key, info.st_size))


def _is_stale_temp(item: os.DirEntry, now: float) -> bool:
    try:
        age = now - item.stat(follow_symlinks=False).st_mtime
    except OSError:
        return False
    return temp_is_stale(item.name, age)
