"""kvboost's files on disk: where they live, and a lock so one process builds each of them."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import xxhash
from filelock import FileLock

log = logging.getLogger(__name__)
SUMS = ".kvboost-sums.json"      # a published folder's files: name -> [size, xxh3_64]
_WHOLE: set[tuple] = set()       # (folder, marker's mtime) checked whole in this process
_DAMAGED: set[tuple] = set()     # ... and found damaged (said once)


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
    made(parent)
    prune_staging(parent)
    return parent


def made(folder: Path) -> Path:
    """`folder`, made if absent; an OSError that says where the cache is and how to move it when it
    cannot be (a read-only home, a file in the way)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise type(err)(err.errno, f"kvboost cannot make its cache folder {folder} ({err.strerror or err}); "
                                   "set KVBOOST_HOME to a writable folder") from err
    return folder


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


def drop_orphans(folder: Path, sources: Path, marker: str) -> list[str]:
    """Delete the finished builds in `folder` made from a source under `sources` that is gone (a pack
    of a converted model that `drop_superseded` removed when its GGUF changed: nothing can load
    it again, and each is about the model's size). Sources elsewhere (a user's folder, perhaps on a
    drive not mounted now) are never judged. The names removed."""
    removed, sources = [], sources.resolve()
    for other in folder.iterdir():
        try:
            if not (other / marker).is_file():
                continue
            named = Path((other / marker).read_text())
            if named.is_absolute() and named.parent == sources and not named.exists():
                shutil.rmtree(other)
                removed.append(other.name)
        except (OSError, ValueError):           # removed by another process first; an odd marker
            continue
    return removed


@contextlib.contextmanager
def build_lock(target: Path):
    """Only one process builds `target` (a converted model, a pack file); the others wait, then
    reuse its result. Cross-platform (a lock file beside the target)."""
    made(target.parent)
    with FileLock(str(target.parent / f".{target.name}.lock")):
        yield


def publish(target: Path, write, marker: str, note: str) -> None:
    """Build a folder entry in staging with `write(staging)`, record its files' sizes and checksums
    (SUMS), write its `marker` (text `note`, written last) and give it `target`'s name in one rename
    (replacing an older one). A write that fails (a full disk: safetensors raises its own error) is an
    OSError naming `target`; the staging goes."""
    from safetensors import SafetensorError
    staging = staging_dir(target.parent, ".convert-")
    aside = staging.with_name(staging.name + "-old")    # an older entry goes aside in one rename: a reader
    try:                                                # never meets it half deleted (no SUMS, taken whole)
        try:
            write(staging)
        except SafetensorError as err:
            raise OSError(f"cannot write {target} (a full disk?): {err}") from err
        (staging / SUMS).write_text(json.dumps({f.name: [f.stat().st_size, _checksum(f)] for f in _files(staging)}))
        (staging / marker).write_text(note)
        if target.exists():
            os.replace(target, aside)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(aside, ignore_errors=True)


def published(target: Path, marker: str) -> bool:
    """Whether `target` is a finished entry (its `marker` there) whose files still match the sizes and
    checksums recorded when it was built (a file truncated, overwritten or missing since: logged, False,
    so the caller builds it again). Checked once per process; an entry from before SUMS is taken whole."""
    try:
        stamp = (str(target), (target / marker).stat().st_mtime_ns)
        if stamp in _WHOLE:
            return True
        sums = json.loads((target / SUMS).read_text()) if (target / SUMS).exists() else {}
        if not isinstance(sums, dict):
            raise ValueError(f"{SUMS} holds {type(sums).__name__}, not a map")
        for name, (size, digest) in sums.items():
            path = target / name
            if not path.is_file() or path.stat().st_size != size or _checksum(path) != digest:
                if stamp not in _DAMAGED:
                    log.warning("kvboost: %s is damaged (%s differs from when it was built): building it again",
                                target, name)
                _DAMAGED.add(stamp)
                return False
    except FileNotFoundError:
        return False
    except (OSError, ValueError, TypeError) as err:         # an unreadable or odd SUMS: build again
        log.warning("kvboost: cannot check %s (%s): building it again", target, err)
        return False
    _WHOLE.add(stamp)
    return True


def _files(folder: Path) -> list[Path]:
    return sorted(f for f in folder.iterdir() if f.is_file())


def _checksum(path: Path) -> str:
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while block := f.read(1 << 23):
            digest.update(block)
    return digest.hexdigest()
