"""Report file names, and the pruning rule of a report directory.

Each process writes ``overlay-KEY-PID-INSTANCE.json``: KEY names its server (12 hex digits of the
server id's hash, ``server_id.file_key``), PID is the process id in its own PID namespace and
INSTANCE 8 random hex digits drawn when the process starts (again in a forked child). Two processes
never share a file, even with the same pid in two containers that share the directory, and a
reader of one server globs that server's files only: the /metrics collector never opens another
server's reports, however many the directory holds.

Pruning: when a process registers, report files (``overlay-*.json``) not written for
``PRUNE_AFTER_S`` (24 h) and temporary files (``.overlay-*.tmp``) older than ``TMP_PRUNE_AFTER_S``
are removed from its directory. A live process rewrites its report at least every
``REFRESH_S`` (1 h), so only the files of processes that are gone get old enough. Where more than
``MAX_FILES`` report files remain, the oldest of those not written for ``2 * REFRESH_S`` go too, so
the directory holds at most about ``MAX_FILES`` files plus those of live processes, however often
servers restart.

Reading (``read``): a file named like a report is opened only if it is a regular file of the
directory (never a symbolic link, a FIFO or a device), without blocking and at most
``MAX_REPORT_BYTES`` long; anything else is ``Unreadable`` with why, and the reader skips it.

The directory (``dir_problem``): an explicitly set one must be a directory (or missing, under a
directory: it is created); the default one, ``vllm-overlay-reports-UID`` under the system temp
dir, is created owner-only and refused when it is a symbolic link, not owned by this user or
writable by others.
"""

from __future__ import annotations

import errno
import glob
import os
import stat
import time
from collections.abc import Iterator

PREFIX = "overlay-"
PRUNE_AFTER_S = 24 * 3600.0
TMP_PRUNE_AFTER_S = 600.0
REFRESH_S = 3600.0
MAX_FILES = 512
MAX_REPORT_BYTES = 16 * 2**20  # a report is tens of KB; a larger file is not read
PATH_MAX = 4096  # Linux's limits on a path and on one of its names
NAME_MAX = 255


class Unreadable(Exception):
    """A file named like a report that is not read: the message says why."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "not a regular file"


def check_entry(st: os.stat_result, limit: int = MAX_REPORT_BYTES) -> None:
    """Raise Unreadable unless ``st`` (an lstat) is a regular file of at most ``limit`` bytes."""
    if not stat.S_ISREG(st.st_mode):
        raise Unreadable(f"{_kind(st.st_mode)}, not a regular file: never opened")
    if st.st_size > limit:
        raise Unreadable(f"{st.st_size} bytes, over the {limit} a report may have: not read")


def read(path: str, limit: int = MAX_REPORT_BYTES) -> bytes:
    """The bytes of the regular file ``path``: checked with lstat first, then opened without
    following a symbolic link and without blocking (O_NOFOLLOW | O_NONBLOCK; a FIFO or device
    swapped in after the check is seen by fstat and not read), and read to at most ``limit``
    bytes. Raises FileNotFoundError when it is gone, Unreadable otherwise."""
    check_entry(os.lstat(path), limit)
    flags = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
             | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Unreadable("a symbolic link, not a regular file: never opened") from None
        raise Unreadable(f"cannot open it: {exc.strerror}") from None
    try:
        check_entry(os.fstat(fd), limit)
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise Unreadable(f"more than the {limit} bytes a report may have: not read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def entries(directory: str, key: str | None = None) -> Iterator[tuple[str, os.stat_result]]:
    """(path, lstat) of every ``overlay-*.json`` of ``directory`` (of one server's ``key``, if
    given), without following a link or opening a file."""
    prefix = f"{PREFIX}{key}-" if key is not None else PREFIX
    try:
        listing = list(os.scandir(directory))
    except OSError:
        return
    for entry in listing:
        if entry.name.startswith(prefix) and entry.name.endswith(".json"):
            try:
                yield entry.path, entry.stat(follow_symlinks=False)
            except OSError:
                continue  # removed since the listing


def default_dir() -> str:
    import tempfile

    uid = os.geteuid() if hasattr(os, "geteuid") else 0
    return os.path.join(tempfile.gettempdir(), f"vllm-overlay-reports-{uid}")


def dir_problem(path: str, default: bool) -> str | None:
    """Why ``path`` cannot be the report directory, or None (see the module docstring). Looks only:
    creates nothing."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        parent = os.path.dirname(path.rstrip(os.sep)) or os.sep
        while not os.path.lexists(parent) and parent != os.path.dirname(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            return f"cannot be created: {parent} is not a directory"
        return None
    except OSError as exc:
        return f"cannot be read: {exc.strerror}"
    if default:
        uid = os.geteuid()
        if stat.S_ISLNK(st.st_mode):
            return "is a symbolic link (the default directory must be a real directory of this user)"
        if not stat.S_ISDIR(st.st_mode):
            return f"is {_kind(st.st_mode)}, not a directory"
        if st.st_uid != uid:
            return f"is owned by uid {st.st_uid}, not by this user (uid {uid})"
        if st.st_mode & 0o022:
            return f"is writable by others (mode {stat.S_IMODE(st.st_mode):04o}; it must not be group- or world-writable)"
        return None
    if not os.path.isdir(path):  # a link to a directory the user named is theirs to name
        try:
            kind = _kind(os.stat(path).st_mode)
        except OSError:
            kind = "a dangling symbolic link"
        return f"is {kind}, not a directory"
    return None


def prepare(path: str, default: bool) -> None:
    """Create the report directory (owner-only where it is the default) and check it; raises
    OSError or ValueError(why)."""
    if not os.path.lexists(path):
        os.makedirs(path, mode=0o700, exist_ok=True)
    why = dir_problem(path, default)
    if why is not None:
        raise ValueError(f"the report directory {path} {why}")


def name(key: str, pid: int, instance: str) -> str:
    return f"{PREFIX}{key}-{pid}-{instance}.json"


def server_glob(directory: str, key: str) -> str:
    return os.path.join(glob.escape(directory), f"{PREFIX}{key}-*.json")


def all_glob(directory: str) -> str:
    return os.path.join(glob.escape(directory), f"{PREFIX}*.json")


def prune(directory: str, now: float | None = None) -> list[str]:
    """Remove the stale files of ``directory`` (see the module docstring); returns their paths."""
    now = time.time() if now is None else now
    removed: list[str] = []
    kept: list[tuple[float, str]] = []  # report files left by age: (mtime, path)
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        if entry.name.startswith(PREFIX) and entry.name.endswith(".json"):
            limit = PRUNE_AFTER_S
        elif entry.name.startswith("." + PREFIX) and entry.name.endswith(".tmp"):
            limit = TMP_PRUNE_AFTER_S
        else:
            continue
        try:
            mtime = entry.stat(follow_symlinks=False).st_mtime
            if now - mtime > limit:
                os.unlink(entry.path)
                removed.append(entry.path)
            elif limit == PRUNE_AFTER_S:
                kept.append((mtime, entry.path))
        except OSError:
            continue  # gone already, or not ours to remove
    idle = sorted((m, p) for m, p in kept if now - m > 2 * REFRESH_S)  # no live process writes these
    for _, path in idle[:max(0, len(kept) - MAX_FILES)]:
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue
    return removed
