"""kvboost's files on disk: where they live, and a lock so one process builds each of them."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from filelock import FileLock


def cache_home() -> Path:
    """Root of kvboost's on-disk files: $KVBOOST_HOME, else $XDG_CACHE_HOME/kvboost, else ~/.cache/kvboost."""
    if os.environ.get("KVBOOST_HOME"):
        return Path(os.environ["KVBOOST_HOME"]).expanduser()          # "~/kvb" as .env files and Docker set it
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvboost"


STAGING_PREFIXES = (".convert-", ".pack-", ".fetch-", ".tmp")   # what a build writes before the rename
STALE_STAGING_S = 86400          # no build takes a day: staging that old is a killed process's


def staging_dir(parent: Path, prefix: str) -> Path:
    """A new folder in `parent` to build a cache entry in before it takes its name: readable by all
    (mkdtemp's 0700 would lock other users of a shared $KVBOOST_HOME out of the entry). Staging left
    there by builds killed over a day ago goes first (prune_staging)."""
    staging = Path(tempfile.mkdtemp(prefix=prefix, dir=build_folder(parent)))
    staging.chmod(0o755)
    return staging


def build_folder(parent: Path) -> Path:
    """`parent`, made if absent, with the staging of builds killed over a day ago removed from it."""
    parent.mkdir(parents=True, exist_ok=True)
    prune_staging(parent)
    return parent


def prune_staging(parent: Path, older_than_s: float = STALE_STAGING_S) -> list[str]:
    """Remove from `parent` the staging folders and files (STAGING_PREFIXES) untouched for
    `older_than_s`: a process killed mid-build leaves them (hundreds of MB each) and nothing else
    would. The names removed; anything that cannot be removed is passed over."""
    removed, cutoff = [], time.time() - older_than_s
    try:
        entries = [e for e in parent.iterdir() if e.name.startswith(STAGING_PREFIXES)]
    except OSError:
        return removed
    for entry in entries:
        try:
            if entry.lstat().st_mtime >= cutoff:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry.name)
        except OSError:
            continue
    return removed


def drop_superseded(target: Path, source: Path, marker: str, suffix: str = "") -> list[str]:
    """Delete the other finished builds beside `target` of the same `source` (the file or folder
    its `marker` file names by absolute path: a relative one, as older builds wrote, may name another file
    from another working directory, and is passed over) whose names differ from `target`'s only in the
    16-digit identity hash before `suffix`: built by an earlier format version, or before the
    source changed (size, mtime). Nothing loads them again and each is about the source's size.
    A process still mapping one keeps its pages until it exits. The names removed."""
    stem, source = target.name[:len(target.name) - len(suffix) - 16], source.resolve()
    pattern, removed = re.compile(re.escape(stem) + "[0-9a-f]{16}" + re.escape(suffix)), []
    for other in target.parent.iterdir():
        try:
            if other == target or not pattern.fullmatch(other.name) or not (other / marker).is_file():
                continue
            named = Path((other / marker).read_text())
            if named.is_absolute() and named.resolve() == source:
                shutil.rmtree(other)
                removed.append(other.name)
        except (OSError, ValueError):           # removed by another process first; an odd marker
            continue
    return removed


@contextlib.contextmanager
def build_lock(target: Path):
    """Only one process builds `target` (a converted model, a pack file); the others wait, then
    reuse its result. Cross-platform (a lock file beside the target)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{target.name}.lock")):
        yield
