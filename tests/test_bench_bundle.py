"""The offline bundle of bench/gpu/ (prepare.sh packs, device_install.sh unpacks on the GPU host) on a
tiny fake payload, no downloads: parts, the copy in two goes, checksums, reassembly."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

GPU = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "gpu")


def bundle(*args: str) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    return subprocess.run([sys.executable, os.path.join(GPU, "bundle.py"), *args], capture_output=True, text=True)


@pytest.mark.parametrize("compression", ["none", pytest.param("zstd", marks=pytest.mark.skipif(
    shutil.which("zstd") is None, reason="no zstd command"))])
def test_parts_travel_in_pieces_and_unpack_whole(tmp_path, compression: str) -> None:  # type: ignore[no-untyped-def]
    payload, out, keep = tmp_path / "payload", tmp_path / "checkout" / ".gpu" / "9.9.9", tmp_path / "keep"
    os.makedirs(payload / "site" / "vllm")
    os.makedirs(payload / "wheels")
    (payload / "site" / "vllm" / "__init__.py").write_text("__version__ = '9.9.9'\n")
    blob = os.urandom(300_000)  # incompressible: several parts of 64 KiB either way
    (payload / "wheels" / "fake-1.0-py3-none-any.whl").write_bytes(blob)
    (tmp_path / "zstandard.whl").write_bytes(b"wheel")
    assert bundle("pack", str(payload), str(out), "--part-size", "64K", "--compression", compression,
                  "--add", str(tmp_path / "zstandard.whl")).returncode == 0
    parts = sorted(f for f in os.listdir(out) if f.startswith("part"))
    assert len(parts) >= 5 and all(os.path.getsize(out / f) <= 65536 for f in parts)
    assert [ln.split("  ")[1] for ln in (out / "MANIFEST").read_text().splitlines()] == [*parts, "zstandard.whl"]
    shutil.copytree(out, keep)
    os.remove(out / parts[-1])  # the first copy brings all but the last part
    host = {**os.environ, "DEVICE_TMP": str(tmp_path / "host")}
    install = ["bash", os.path.join(GPU, "device_install.sh"), "9.9.9"]
    run = subprocess.run(install, cwd=out.parent.parent, env=host, capture_output=True, text=True)
    assert run.returncode == 0 and f"vLLM 9.9.9: still missing: {parts[-1]}" in run.stdout, run.stdout + run.stderr
    stage = tmp_path / "host" / "stage-9.9.9"
    assert sorted(os.listdir(stage)) == sorted([*parts[:-1], "zstandard.whl", "MANIFEST"]) and not os.listdir(out)
    shutil.copy(keep / parts[-1], out / parts[-1])  # the second copy, with a part damaged on the way
    with open(stage / parts[1], "r+b") as f:
        f.write(b"\0damaged")
    run = subprocess.run(install, cwd=out.parent.parent, env=host, capture_output=True, text=True)
    assert run.returncode == 1 and f"checksum differs from MANIFEST: {parts[1]}" in run.stderr, run.stdout + run.stderr
    assert not os.path.exists(tmp_path / "host" / "site")
    shutil.copy(keep / parts[1], stage / parts[1])  # copied again: the parts reassemble into the payload
    assert bundle("check", str(stage)).returncode == 0
    assert bundle("unpack", str(stage), str(tmp_path / "got")).returncode == 0
    assert (tmp_path / "got" / "wheels" / "fake-1.0-py3-none-any.whl").read_bytes() == blob
    assert (tmp_path / "got" / "site" / "vllm" / "__init__.py").read_text() == "__version__ = '9.9.9'\n"


def test_prepare_without_a_wheel_list_names_both_ways_out(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A release with no device-wheels list: prepare.sh stops before downloading anything and says
    how to get one (HOST_PACKAGES to make it, DEVICE_WHEELS to bring one); a HOST_PACKAGES file that
    does not exist is named."""
    env = {k: v for k, v in os.environ.items() if k not in ("DEVICE_WHEELS", "HOST_PACKAGES")}
    run = subprocess.run(["bash", os.path.join(GPU, "prepare.sh"), "9.9.9"], capture_output=True, text=True,
                         env=env, cwd=GPU)
    assert run.returncode == 2, run.stderr
    assert "no wheel list for vLLM 9.9.9" in run.stderr
    assert "HOST_PACKAGES=FILE" in run.stderr and "DEVICE_WHEELS=FILE" in run.stderr
    missing = str(tmp_path / "freeze.txt")
    run = subprocess.run(["bash", os.path.join(GPU, "prepare.sh"), "9.9.9"], capture_output=True, text=True,
                         env={**env, "HOST_PACKAGES": missing}, cwd=GPU)
    assert run.returncode == 2 and f"HOST_PACKAGES={missing}: no such file" in run.stderr, run.stderr
    run = subprocess.run(["bash", os.path.join(GPU, "prepare.sh"), "9.9.9"], capture_output=True, text=True,
                         env={**env, "DEVICE_WHEELS": missing}, cwd=GPU)
    assert run.returncode == 2 and f"DEVICE_WHEELS={missing}: no such file" in run.stderr, run.stderr
    assert not os.path.exists(os.path.join(GPU, "device-wheels-9.9.9.txt"))


@pytest.mark.skipif(shutil.which("zstd") is None, reason="no zstd command")
def test_compile_caches_travel_to_a_fresh_host_and_back_in_place(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """compile_cache.sh packs vLLM's compile cache and Triton's cache into parts that fit what a GPU call
    brings back, refuses (exit 3, nothing written) beyond CACHE_MAX, and restores them on a fresh host to
    the same places, byte for byte, only for the overlay sources they were packed from (whether vLLM then
    loads them is for a GPU run: vLLM keys its entries). A copy of the scripts in a checkout of its own,
    so that its sources can change between pack and restore."""
    checkout = tmp_path / "checkout"
    os.makedirs(checkout / "bench" / "gpu")
    os.makedirs(checkout / "src" / "vllm_overlay")
    for name in ("compile_cache.sh", "bundle.py"):
        shutil.copy(os.path.join(GPU, name), checkout / "bench" / "gpu" / name)
    (checkout / "src" / "vllm_overlay" / "patch.py").write_text("A = 1\n")
    script = str(checkout / "bench" / "gpu" / "compile_cache.sh")
    host = tmp_path / "host"
    aot = host / ".cache" / "vllm" / "torch_compile_cache" / "torch_aot_compile" / "abc" / "rank_0_0"
    tri = host / ".triton" / "cache" / "K1"
    os.makedirs(aot)
    os.makedirs(tri)
    (aot / "model").write_bytes(os.urandom(200_000))
    (tri / "k.cubin").write_bytes(b"cubin")
    env = {**os.environ, "HOME": str(host), "DEVICE_TMP": str(tmp_path / "t"), "PART_SIZE": "64K"}
    for k in ("VLLM_CACHE_ROOT", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "CACHE_ANY_SOURCES", "CACHE_MAX"):
        env.pop(k, None)

    def run(*args: str, **extra: str) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
        return subprocess.run(["bash", script, *args], env={**env, **extra}, capture_output=True, text=True)

    sizes = run("sizes")
    assert sizes.returncode == 0 and f"bytes in {host}/.cache/vllm/torch_compile_cache" in sizes.stdout, sizes.stdout
    refused = run("pack", str(tmp_path / "small"), CACHE_MAX="100K")
    assert refused.returncode == 3 and "more than CACHE_MAX=100K (102400)" in refused.stderr, refused.stderr
    assert not (tmp_path / "small").exists()
    bad = run("pack", str(tmp_path / "x"), CACHE_MAX="lots")
    assert bad.returncode == 2 and "CACHE_MAX=lots: expected bytes" in bad.stderr, bad.stderr
    packed = run("pack", str(tmp_path / "out"))
    assert packed.returncode == 0, packed.stderr
    parts = sorted(f for f in os.listdir(tmp_path / "out") if f.startswith("part"))
    assert len(parts) >= 3 and all(os.path.getsize(tmp_path / "out" / p) <= 65536 for p in parts)
    shutil.rmtree(host)  # the next host starts without either cache
    (checkout / "src" / "vllm_overlay" / "patch.py").write_text("A = 2\n")
    stale = run("restore", str(tmp_path / "out"))
    assert stale.returncode == 4 and "packed from other overlay sources" in stale.stderr, stale.stderr
    assert not host.exists()
    (checkout / "src" / "vllm_overlay" / "patch.py").write_text("A = 1\n")
    restored = run("restore", str(tmp_path / "out"))
    assert restored.returncode == 0 and restored.stdout.count("restored") == 2, restored.stdout + restored.stderr
    assert (aot / "model").stat().st_size == 200_000 and (tri / "k.cubin").read_bytes() == b"cubin"
