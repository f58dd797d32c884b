"""The offline bundle of bench/gpu/ (prepare.sh packs, device_install.sh unpacks on the GPU host) on a
tiny fake payload, no downloads: split into parts, the parts copied over in two goes, checksums,
reassembly."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = os.path.join(ROOT, "bench", "gpu")
HAVE_ZSTD = shutil.which("zstd") is not None


def bundle(*args: str) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    return subprocess.run([sys.executable, os.path.join(GPU, "bundle.py"), *args], capture_output=True, text=True)


@pytest.mark.parametrize("compression", ["none", pytest.param("zstd", marks=pytest.mark.skipif(
    not HAVE_ZSTD, reason="no zstd command"))])
def test_parts_travel_in_pieces_and_unpack_whole(tmp_path, compression: str) -> None:  # type: ignore[no-untyped-def]
    payload = tmp_path / "payload"
    os.makedirs(payload / "site" / "vllm")
    os.makedirs(payload / "wheels")
    (payload / "site" / "vllm" / "__init__.py").write_text("__version__ = '9.9.9'\n")
    blob = os.urandom(300_000)  # incompressible: several parts of 64 KiB either way
    (payload / "wheels" / "fake-1.0-py3-none-any.whl").write_bytes(blob)
    (tmp_path / "zstandard.whl").write_bytes(b"wheel")
    out = tmp_path / "checkout" / ".gpu" / "9.9.9"
    p = bundle("pack", str(payload), str(out), "--part-size", "64K", "--compression", compression,
               "--add", str(tmp_path / "zstandard.whl"))
    assert p.returncode == 0, p.stderr
    parts = sorted(f for f in os.listdir(out) if f.startswith("part"))
    assert len(parts) >= 5 and all(os.path.getsize(out / f) <= 65536 for f in parts)
    listed = [ln.split("  ")[1] for ln in (out / "MANIFEST").read_text().splitlines()]
    assert listed == [*parts, "zstandard.whl"]
    if shutil.which("sha256sum"):  # the MANIFEST is sha256sum's format
        assert subprocess.run(["sha256sum", "--quiet", "-c", "MANIFEST"], cwd=out).returncode == 0
    keep = tmp_path / "keep"
    shutil.copytree(out, keep)
    # the first copy brings all but the last part: device_install.sh moves them aside and names what is missing
    os.remove(out / parts[-1])
    host = {**os.environ, "DEVICE_TMP": str(tmp_path / "host")}

    def install() -> subprocess.CompletedProcess:  # type: ignore[type-arg]
        return subprocess.run(["bash", os.path.join(GPU, "device_install.sh"), "9.9.9"], cwd=tmp_path / "checkout",
                              env=host, capture_output=True, text=True)

    run = install()
    assert run.returncode == 0 and f"vLLM 9.9.9: still missing: {parts[-1]}" in run.stdout, run.stdout + run.stderr
    stage = tmp_path / "host" / "stage-9.9.9"
    assert sorted(os.listdir(stage)) == sorted([*parts[:-1], "zstandard.whl", "MANIFEST"]) and not os.listdir(out)
    # the second copy brings the last part; one that arrived damaged is named, and nothing is unpacked
    shutil.copy(keep / parts[-1], out / parts[-1])
    with open(stage / parts[1], "r+b") as f:
        f.write(b"\0damaged")
    run = install()
    assert run.returncode == 1 and f"checksum differs from MANIFEST: {parts[1]}" in run.stderr, run.stdout + run.stderr
    assert not os.path.exists(tmp_path / "host" / "site")
    # copied again: every checksum matches and the parts reassemble into the payload
    shutil.copy(keep / parts[1], stage / parts[1])
    assert bundle("check", str(stage)).returncode == 0
    got = bundle("unpack", str(stage), str(tmp_path / "unpacked"))
    assert got.returncode == 0, got.stderr
    assert (tmp_path / "unpacked" / "wheels" / "fake-1.0-py3-none-any.whl").read_bytes() == blob
    assert (tmp_path / "unpacked" / "site" / "vllm" / "__init__.py").read_text() == "__version__ = '9.9.9'\n"
