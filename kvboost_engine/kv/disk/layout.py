"""Where entries live in the directory, and the small file operations the tier needs.

    {directory}/kv-v{FORMAT_VERSION}-{fingerprint hex}/{key hex[:2]}/{key hex}.kv
    ... /{key hex[:2]}/.{key hex}.kv.{host}-{pid}.{thread}.tmp     (a write in progress)

Each fingerprint (and format version) has its own subdirectory: a tier never reads, counts
or deletes another's files. The two-character fan-out keeps directories small. A temp file
names its writer (host tag and pid), so one left by a killed writer is removed at the next
start. Entry files are opened only when they are regular files: never a FIFO (which would
block), a device, or a symlink (which could lead out of the directory).
"""
from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import threading
import time
from pathlib import Path

import xxhash

from ...errors import InputError
from .fileformat import FORMAT_VERSION

log = logging.getLogger(__name__)

KEY_BYTES = 16
DISK_SLACK = 64 << 10         # a new fan-out folder and the last block of a file
STALE_TEMP_SECONDS = 600      # a temp file of a live pid this old is left over (the pid was reused)
FOREIGN_TEMP_SECONDS = 30     # a temp file whose writer cannot be checked (other host, old name) this old
HOST_TAG = xxhash.xxh32_hexdigest(socket.gethostname().encode())   # pids are only comparable on one host
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_DIR_FD = os.open in os.supports_dir_fd and hasattr(os, "O_DIRECTORY")


class NotRegularFile(OSError):
    """An entry name that is not a regular file (a FIFO, a device, a symlink, a folder): junk."""


def tier_root(directory, fingerprint: bytes) -> Path:
    return Path(directory) / f"kv-v{FORMAT_VERSION}-{fingerprint.hex()}"


def entry_path(root: Path, key: bytes) -> Path:
    name = key.hex()
    return root / name[:2] / f"{name}.kv"


def temp_path(path: Path) -> Path:
    """A name no other thread or process writes to, in the same directory (so rename is atomic)."""
    return path.with_name(f".{path.name}.{HOST_TAG}-{os.getpid()}.{threading.get_ident()}.tmp")


def key_of(name: str) -> bytes | None:
    """The key a file name stands for, or None if it is not an entry file."""
    stem, _, ext = name.partition(".")
    if ext != "kv" or len(stem) != 2 * KEY_BYTES:
        return None
    try:
        return bytes.fromhex(stem)
    except ValueError:
        return None


def open_regular(path: Path) -> tuple[int, os.stat_result]:
    """(fd, stat) of the regular file at `path`, opened read-only without blocking and without
    following a symlink (at the file or at its folder). Raises NotRegularFile when the name is
    not a regular file, OSError for anything else (missing, or a symlinked folder)."""
    try:
        if _DIR_FD:
            folder = os.open(path.parent, _DIR_FLAGS)
            try:
                fd = os.open(path.name, _READ_FLAGS, dir_fd=folder)
            finally:
                os.close(folder)
        else:                                   # pragma: no cover - platforms without dir_fd
            fd = os.open(path, _READ_FLAGS)
    except OSError as error:
        if error.errno == errno.ELOOP and not os.path.islink(path.parent):
            raise NotRegularFile(errno.ELOOP, "a symlink, not a regular file", str(path)) from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise NotRegularFile(errno.EINVAL, f"not a regular file (mode {info.st_mode:o})", str(path))
    return fd, info


def temp_is_stale(name: str, age_seconds: float) -> bool:
    """Whether the temp file `name` (this old) is left over by a writer that will not finish it."""
    owner = name.rsplit(".", 3)[1] if name.count(".") >= 4 else ""
    host, _, pid = owner.partition("-")
    if host != HOST_TAG or not pid.isdigit():
        return age_seconds > FOREIGN_TEMP_SECONDS
    alive = pid_alive(int(pid))
    if alive is None:
        return age_seconds > FOREIGN_TEMP_SECONDS
    return not alive or age_seconds > STALE_TEMP_SECONDS


def pid_alive(pid: int) -> bool | None:
    """Whether process `pid` exists on this host; None where that cannot be checked."""
    if os.name != "posix":              # os.kill(pid, 0) would terminate the process on Windows
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:                     # EPERM: it exists, owned by someone else
        return True
    return True


def prepare_root(root: Path) -> bool:
    """Create the tier's folder if needed; whether it can be written."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as error:
        raise NotADirectoryError(f"the disk cache directory cannot hold {root}: {error}") from None
    except OSError:
        return False                    # no permission, a read-only file system
    return writable(root)


def still_names(path: Path, fd: int | None) -> bool:
    """Whether `path` still names the file that was found bad (not one written since)."""
    try:
        now = os.lstat(path)
    except OSError:
        return False
    if fd is None:
        return not stat.S_ISREG(now.st_mode)
    return now.st_ino == os.fstat(fd).st_ino


def writable(folder: Path) -> bool:
    """Whether files can be created in `folder` (tried, not guessed from permission bits, which
    do not bind root, nor tell a read-only mount)."""
    probe = folder / f".probe.kv.{HOST_TAG}-{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except OSError:
        return False
    unlink(probe)
    return True


def write_atomically(path: Path, write, fsync: bool) -> OSError | None:
    """Write a file through `write(fd)` under a temp name, then rename it into place, so no reader
    ever sees it partial. None when written; else the error, with no file and no temp left."""
    temp = temp_path(path)
    if os.path.islink(path.parent):
        return OSError(errno.ELOOP, "its folder is a symlink", str(path.parent))
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)   # even if removed by hand meanwhile
        try:
            fd = os.open(temp, flags, 0o644)
        except FileNotFoundError:                        # emptied and removed by an eviction meanwhile
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(temp, flags, 0o644)
        try:
            write(fd)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except OSError as error:
        unlink(temp)
        return error
    stamp(path)
    return None


def disk_shortfall(folder: Path, size: int) -> int:
    """Bytes the file system holding `folder` lacks for a `size`-byte file (0 when it has room,
    or cannot tell), with one fan-out folder and block rounding to spare."""
    try:
        info = os.statvfs(folder)
    except (OSError, AttributeError):       # AttributeError: no statvfs (Windows)
        return 0
    return max(0, size + DISK_SLACK - info.f_bavail * info.f_frsize)


def room_lacking(error: OSError, path: Path, size: int) -> tuple[int, int]:
    """(bytes, files) a write of `size` bytes at `path` lacked, by its `error`: what evicting entries
    can give. A quota (EDQUOT): the entry's bytes and a file. ENOSPC: the bytes the file system
    lacks, or (inodes all taken, on one that counts them) a file and the fan-out folder if it is
    missing. (0, 0): not for room, or nothing eviction would buy."""
    if error.errno == errno.EDQUOT:
        return size, 1
    if error.errno != errno.ENOSPC:
        return 0, 0
    try:
        info = os.statvfs(path.parent.parent)
    except (OSError, AttributeError):       # AttributeError: no statvfs (Windows)
        return 0, 0
    out_of_inodes = info.f_files and not info.f_favail
    return disk_shortfall(path.parent.parent, size), (2 - path.parent.is_dir() if out_of_inodes else 0)


def check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise InputError(f"disk tier keys are {KEY_BYTES} bytes, got {key!r}")


def stamp(path: Path) -> None:
    """Set the file's mtime to now (ns precision): the LRU order a restart resumes from."""
    now = time.time_ns()
    try:
        os.utime(path, ns=(now, now), follow_symlinks=False)
    except (OSError, NotImplementedError):
        pass


def unlink_entry(path: Path) -> bool:
    """Remove an entry file, and its fan-out folder if that leaves it empty (an empty folder holds an
    inode and a block: on a full file system, room no entry could give back)."""
    removed = unlink(path)
    try:
        os.rmdir(path.parent)
    except OSError:                                     # not empty (the usual case), or gone
        pass
    return removed


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
