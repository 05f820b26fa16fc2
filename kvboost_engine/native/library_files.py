"""The files of built native libraries in $KVBOOST_HOME/native: whether one is whole, its use marks,
removing one the loader refused, and pruning those no process has used for weeks (build.py builds
and loads them)."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from ..paths import build_lock

log = logging.getLogger("kvboost_engine.native.build")
STALE_DAYS = 30          # a library no process has loaded for this long goes when a new one is built
PREFIX = "kvboost-decode-"
DAMAGED = ("invalid ELF header", "no loadable segments", "file too short", "ELF load command")   # not noexec etc.


def inode(path: Path) -> tuple | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def drop_refused(path: Path, refused: tuple | None) -> bool:
    """Remove the library the loader refused, under its build lock, unless another process has put a
    new one at its name meanwhile; False when it cannot be removed (a read-only cache)."""
    try:
        with build_lock(path):
            if inode(path) == refused:
                path.unlink()
    except OSError:
        return False
    return True


def intact(path: Path) -> bool:
    """Whether `path` is a whole 64-bit ELF file: present, and as long as its header says (its section
    header table, which the linker writes last, ends the file), so a library cut short is never mapped."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return False
    if len(head) < 64 or head[:5] != b"\x7fELF\x02":
        return False
    order = "little" if head[5] == 1 else "big"
    shoff = int.from_bytes(head[0x28:0x30], order)
    shentsize, shnum = int.from_bytes(head[0x3A:0x3C], order), int.from_bytes(head[0x3C:0x3E], order)
    return size >= shoff + shentsize * shnum


def mark_used(path: Path) -> None:
    """The library's mtime set to now: loaded, so not stale (prune). Best effort (a read-only cache)."""
    try:
        os.utime(path)
    except OSError:
        pass


def prune(keep: Path, days: float = STALE_DAYS) -> list[str]:
    """Remove from `keep`'s folder the libraries (other than `keep`) unused for `days` (by mtime: set
    when built and at each load), their lock files and lock files as old with no library (a failed
    build's), and the staging files of builds killed over a day ago; the names removed. Anything
    another process removes first, or that cannot be removed, is passed over. A lock file is removed
    only with its target unused for weeks: were a build of that target under way, a second process
    could build it beside it, each into its own staging file, one replacing the other (the same bytes)."""
    now = time.time()
    cutoff, staging_cutoff = now - days * 86400, now - 86400
    removed = []
    try:
        entries = list(keep.parent.iterdir())
    except OSError:
        return removed
    names = {entry.name for entry in entries}
    for entry in entries:
        name = entry.name
        if entry == keep:
            continue
        library = name.startswith(PREFIX) and name.endswith(".so")
        orphan_lock = (name.startswith("." + PREFIX) and name.endswith(".so.lock")
                       and name[1:-len(".lock")] not in names)
        staging = name.startswith(".build-") and name.endswith(".so")
        if not (library or orphan_lock or staging):
            continue
        try:
            if entry.stat().st_mtime >= (staging_cutoff if staging else cutoff):
                continue
            entry.unlink()
            removed.append(name)
            if library:
                (entry.parent / f".{name}.lock").unlink(missing_ok=True)
        except OSError:
            continue
    if removed:
        log.info("kvboost native: removed %d files unused for %s days from %s", len(removed), days, keep.parent)
    return removed
