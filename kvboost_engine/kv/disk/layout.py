"""Where entries live in the directory, and the small file operations the tier needs.

    {directory}/kv-v{FORMAT_VERSION}-{fingerprint hex}/{key hex[:2]}/{key hex}.kv
    ... /{key hex[:2]}/.{key hex}.kv.{pid}.{thread}.tmp     (a write in progress)

Each fingerprint (and format version) has its own subdirectory: a tier never reads, counts
or deletes another's files. The two-character fan-out keeps directories small.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from .fileformat import FORMAT_VERSION

log = logging.getLogger(__name__)

KEY_BYTES = 16
STALE_TEMP_SECONDS = 600      # a temp file this old is left over from a crashed writer


def tier_root(directory, fingerprint: bytes) -> Path:
    return Path(directory) / f"kv-v{FORMAT_VERSION}-{fingerprint.hex()}"


def entry_path(root: Path, key: bytes) -> Path:
    name = key.hex()
    return root / name[:2] / f"{name}.kv"


def temp_path(path: Path) -> Path:
    """A name no other thread or process writes to, in the same directory (so rename is atomic)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def key_of(name: str) -> bytes | None:
    """The key a file name stands for, or None if it is not an entry file."""
    stem, _, ext = name.partition(".")
    if ext != "kv" or len(stem) != 2 * KEY_BYTES:
        return None
    try:
        return bytes.fromhex(stem)
    except ValueError:
        return None


def scan(root: Path) -> list[tuple[bytes, int]]:
    """(key, size) of every entry file under `root`, least recently used (oldest mtime)
    first; removes temp files older than STALE_TEMP_SECONDS on the way."""
    found, now = [], time.time()
    for sub in os.scandir(root):
        if not sub.is_dir() or len(sub.name) != 2:
            continue
        for item in os.scandir(sub.path):
            key = key_of(item.name)
            try:
                info = item.stat()
            except OSError:
                continue                 # removed meanwhile by another process
            if key is not None:
                found.append((info.st_mtime_ns, key, info.st_size))
            elif item.name.endswith(".tmp") and now - info.st_mtime > STALE_TEMP_SECONDS:
                unlink(Path(item.path))
    return [(key, size) for _, key, size in sorted(found)]


def stamp(path: Path) -> None:
    """Set the file's mtime to now (ns precision): the LRU order a restart resumes from."""
    now = time.time_ns()
    try:
        os.utime(path, ns=(now, now))
    except OSError:
        pass


def unlink(path: Path) -> bool:
    """Remove a file; False if it was already gone (or cannot be removed: logged)."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as error:
        log.warning("kvboost disk tier: could not remove %s: %s", path, error)
        return False
