"""kvboost's files on disk: where they live, and a lock so one process builds each of them."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from filelock import FileLock


def cache_home() -> Path:
    """Root of kvboost's on-disk files: $KVBOOST_HOME, else $XDG_CACHE_HOME/kvboost, else ~/.cache/kvboost."""
    if os.environ.get("KVBOOST_HOME"):
        return Path(os.environ["KVBOOST_HOME"]).expanduser()          # "~/kvb" as .env files and Docker set it
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvboost"


def staging_dir(parent: Path, prefix: str) -> Path:
    """A new folder in `parent` to build a cache entry in before it takes its name: readable by all
    (mkdtemp's 0700 would lock other users of a shared $KVBOOST_HOME out of the entry)."""
    staging = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    staging.chmod(0o755)
    return staging


@contextlib.contextmanager
def build_lock(target: Path):
    """Only one process builds `target` (a converted model, a pack file); the others wait, then
    reuse its result. Cross-platform (a lock file beside the target)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{target.name}.lock")):
        yield
