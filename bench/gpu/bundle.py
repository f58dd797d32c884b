"""An offline bundle: a folder packed as one tar (zstd-compressed where zstd is available), split into
parts of at most a given size, with a MANIFEST of their sha256 sums (sha256sum's format, so
`sha256sum -c MANIFEST` checks it too); then, on the other host, checked and unpacked. Stdlib only;
zstd through the `zstd` command or the `zstandard` module (packing prefers the command, unpacking the
module), whichever is there.

  python3 bench/gpu/bundle.py pack FOLDER OUT [--part-size 48M] [--compression zstd|none] [--level 19] [--add FILE ...]
  python3 bench/gpu/bundle.py check STAGE     # exit 0: every part there and its sum matches;
                                              # 3: parts missing (named); 1: a sum differs (named)
  python3 bench/gpu/bundle.py unpack STAGE DEST

`--add` files (e.g. the zstandard wheel the other host needs to unpack) are copied beside the parts
and listed in the MANIFEST. `unpack` reads the parts in order as one stream and recognises the
compression by the stream's first bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
from typing import IO, Iterator

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
PART = "part{:02d}"


def size_of(text: str) -> int:
    m = re.fullmatch(r"([0-9]+)([KMG]?)", text.strip().upper())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: expected bytes, e.g. 48M, 512K or 0 (one part)")
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)]


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def zstd_module():  # type: ignore[no-untyped-def]
    try:
        import zstandard

        return zstandard
    except ImportError:
        return None


class PartWriter(io.RawIOBase):
    """Writes a stream into OUT/part00, part01, ... of at most ``size`` bytes each (0: one part)."""

    def __init__(self, out: str, size: int) -> None:
        self.out, self.size, self.n, self.f, self.used, self.names = out, size, 0, None, 0, []

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[no-untyped-def,override]
        view, done = memoryview(b), 0
        while done < len(view):
            if self.f is None or (self.size and self.used >= self.size):
                self._next()
            room = len(view) - done if not self.size else min(len(view) - done, self.size - self.used)
            self.f.write(view[done:done + room])
            self.used += room
            done += room
        return done

    def _next(self) -> None:
        if self.f is not None:
            self.f.close()
        name = PART.format(self.n)
        self.f, self.used, self.n = open(os.path.join(self.out, name), "wb"), 0, self.n + 1
        self.names.append(name)

    def close(self) -> None:
        if self.f is None:
            self._next()  # an empty stream still makes one part
        self.f.close()
        super().close()


def pack(folder: str, out: str, part_size: int, compression: str, add: list[str], level: int = 19) -> list[str]:
    os.makedirs(out, exist_ok=True)
    for old in os.listdir(out):
        if re.fullmatch(r"part[0-9]+", old) or old == "MANIFEST":
            os.remove(os.path.join(out, old))
    parts = PartWriter(out, part_size)
    names = sorted(os.listdir(folder))
    if compression == "none":
        with tarfile.open(fileobj=parts, mode="w|") as tar:
            for n in names:
                tar.add(os.path.join(folder, n), arcname=n)
    elif shutil.which("zstd"):  # as used to build the parts of 2026-12-01
        tar_cmd = subprocess.Popen(["tar", "-C", folder, "-cf", "-", *names], stdout=subprocess.PIPE)
        zstd = subprocess.Popen(["zstd", "-q", "-T0", f"-{level}", "--long=27", "-c"], stdin=tar_cmd.stdout,
                                stdout=subprocess.PIPE)
        assert tar_cmd.stdout is not None and zstd.stdout is not None
        tar_cmd.stdout.close()
        shutil.copyfileobj(zstd.stdout, parts, 1 << 20)
        if zstd.wait() or tar_cmd.wait():
            sys.exit("bundle: tar | zstd failed")
    elif zstd_module() is not None:
        z = zstd_module()
        params = z.ZstdCompressionParameters.from_level(level, window_log=27, threads=-1)
        with z.ZstdCompressor(compression_params=params).stream_writer(parts, closefd=False) as w:
            with tarfile.open(fileobj=w, mode="w|") as tar:
                for n in names:
                    tar.add(os.path.join(folder, n), arcname=n)
    else:
        sys.exit("bundle: pack --compression zstd needs the zstandard module or the zstd command "
                 "(or pass --compression none)")
    parts.close()
    listed = list(parts.names)
    for f in add:
        shutil.copy(f, os.path.join(out, os.path.basename(f)))
        listed.append(os.path.basename(f))
    with open(os.path.join(out, "MANIFEST"), "w") as m:
        for n in listed:
            m.write(f"{sha256(os.path.join(out, n))}  {n}\n")
    return listed


def manifest(stage: str) -> list[tuple[str, str]]:
    path = os.path.join(stage, "MANIFEST")
    if not os.path.isfile(path):
        return []
    out = []
    for line in open(path):
        digest, _, name = line.strip().partition("  ")
        if digest and name:
            out.append((digest, name))
    return out


def check(stage: str) -> tuple[int, str]:
    listed = manifest(stage)
    if not listed:
        return 3, f"no MANIFEST in {stage} yet"
    missing = [n for _, n in listed if not os.path.isfile(os.path.join(stage, n))]
    if missing:
        return 3, "still missing: " + " ".join(missing)
    wrong = [n for d, n in listed if sha256(os.path.join(stage, n)) != d]
    if wrong:
        return 1, "checksum differs from MANIFEST: " + " ".join(wrong) + " (copy it again)"
    return 0, f"{len(listed)} files, every checksum matches"


class Joined(io.RawIOBase):
    """The parts read one after another as one stream."""

    def __init__(self, paths: list[str]) -> None:
        self.files: Iterator[IO[bytes]] = (open(p, "rb") for p in paths)
        self.f: IO[bytes] | None = next(self.files, None)

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[no-untyped-def,override]
        while self.f is not None:
            n = self.f.readinto(b)
            if n:
                return n
            self.f.close()
            self.f = next(self.files, None)
        return 0


def unpack(stage: str, dest: str) -> int:
    rc, why = check(stage)
    if rc:
        sys.exit(f"bundle: {why}")
    parts = [os.path.join(stage, n) for _, n in manifest(stage) if re.fullmatch(r"part[0-9]+", n)]
    with open(parts[0], "rb") as f:
        zstd = f.read(4) == ZSTD_MAGIC
    stream: IO[bytes] = io.BufferedReader(Joined(parts), 1 << 20)
    proc = None
    if zstd and zstd_module() is not None:
        stream = zstd_module().ZstdDecompressor(max_window_size=2**31).stream_reader(stream)
    elif zstd:
        if not shutil.which("zstd"):
            sys.exit("bundle: the parts are zstd-compressed: unpack needs the zstandard module or the zstd command")
        proc = subprocess.Popen(["zstd", "-q", "-d", "--long=31", "-c"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)

        def feed() -> None:
            assert proc is not None and proc.stdin is not None
            shutil.copyfileobj(io.BufferedReader(Joined(parts), 1 << 20), proc.stdin, 1 << 20)
            proc.stdin.close()

        import threading

        threading.Thread(target=feed, daemon=True).start()
        assert proc.stdout is not None
        stream = proc.stdout
    os.makedirs(dest, exist_ok=True)
    trusted = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        tar.extractall(dest, **trusted)  # our own payload: a site-packages tree as packed
    if proc is not None and proc.wait():
        sys.exit("bundle: zstd -d failed")
    return len(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("folder")
    p.add_argument("out")
    p.add_argument("--part-size", type=size_of, default=size_of("48M"))
    p.add_argument("--compression", choices=("zstd", "none"), default="zstd")
    p.add_argument("--level", type=int, default=19, choices=range(1, 20), metavar="1-19",
                   help="zstd level (19: smallest; a payload of wheels, already deflated, packs almost "
                        "as small at 9 in a fraction of the time)")
    p.add_argument("--add", nargs="*", default=[])
    c = sub.add_parser("check")
    c.add_argument("stage")
    u = sub.add_parser("unpack")
    u.add_argument("stage")
    u.add_argument("dest")
    a = ap.parse_args(argv)
    if a.cmd == "pack":
        names = pack(a.folder, a.out, a.part_size, a.compression, a.add, a.level)
        print(f"bundle: {a.out}: {', '.join(names)} and MANIFEST")
        return 0
    if a.cmd == "check":
        rc, why = check(a.stage)
        print(why)
        return rc
    print(f"bundle: unpacked {unpack(a.stage, a.dest)} parts into {a.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
