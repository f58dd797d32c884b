"""decode-gemv's per-user table cache: where `vllm-overlay tune-gemv` writes a device's table and the patch
reads it, and the checks both make before trusting it.

One file per device and vLLM release: ``vllm-overlay/decode-gemv/DEVICE-VLLM.json`` under
$XDG_CACHE_HOME (or ~/.cache), DEVICE the name torch.cuda.get_device_properties gives with every
character other than a letter, a digit, ``.`` or ``-`` written as ``_`` (``NVIDIA_H100_80GB_HBM3-0.33.0.json``).

The folder is created owner-only (0700) and, like the default report folder (docs/security.md), refused
when it is a symbolic link, not owned by this user or writable by group or others; a table file in it is
refused when it is not a regular file (a link, a FIFO), not this user's or writable by others. A table
read from there picks the kernel that runs in every serving process, so nothing is read through a
folder or file someone else could have written.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

from vllm_overlay import report_files

FOLDER = os.path.join("vllm-overlay", "decode-gemv")


def cache_dir(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(cache), FOLDER)


def slug(device: str) -> str:
    return "".join(c if c.isascii() and (c.isalnum() or c in ".-") else "_" for c in device.strip()) or "_"


def cache_file(device: str, vllm: str, environ: Mapping[str, str] | None = None) -> str:
    return os.path.join(cache_dir(environ), f"{slug(device)}-{vllm}.json")


def dir_problem(path: str) -> str | None:
    """Why the cache folder cannot hold tables, or None (a missing one is created owner-only)."""
    return report_files.dir_problem(path, default=True)


def file_problem(path: str) -> str | None:
    """Why a table file of the cache cannot be read, or None; a missing file is "does not exist"."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "does not exist"
    except OSError as exc:
        return f"cannot be read: {exc.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link (a table of the cache must be a regular file of this user)"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"is writable by others (mode {stat.S_IMODE(st.st_mode):04o}; it must not be group- or world-writable)"
    if st.st_size > report_files.MAX_REPORT_BYTES:
        return f"is larger than {report_files.MAX_REPORT_BYTES} bytes: not a table of tile configs"
    return None


def problem(path: str) -> str | None:
    """Why the cached table ``path`` cannot be used: its folder's problem, else its own."""
    folder = os.path.dirname(path)
    why = dir_problem(folder)
    if why is not None:
        return f"its folder {folder} {why}"
    return file_problem(path)
