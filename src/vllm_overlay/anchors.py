"""Checks every source rewrite of the registry against vLLM sources, with no import of vLLM:
the installed vLLM (``verify``), or the files of a downloaded wheel (CI's check for 0.20.2)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from vllm_overlay import sources
from vllm_overlay.errors import AnchorError
from vllm_overlay.mechanisms import rewrite
from vllm_overlay.spec import Rewrite


@dataclass(frozen=True)
class Check:
    patch_id: str
    rw: Rewrite
    ok: bool
    detail: str


def all_rewrites(version: str | None = None) -> Iterator[tuple[str, Rewrite]]:
    from vllm_overlay.core import specs

    for spec in specs():
        for rw in spec.rewrites:
            if version is None or rw.version == version:
                yield spec.id, rw


def check(version: str, read: Callable[[str], str]) -> list[Check]:
    """``read(path)`` returns the text of vllm/<path> for that vLLM version."""
    out = []
    for pid, rw in all_rewrites(version):
        try:
            text = read(rw.path)
        except (OSError, KeyError) as exc:
            out.append(Check(pid, rw, False, f"cannot read vllm/{rw.path}: {exc}"))
            continue
        try:
            rewrite.check_text(rw, text)
            out.append(Check(pid, rw, True, f"hash {rw.sha256[:12]} and {len(rw.edits)} anchor(s) match"))
        except AnchorError as exc:
            out.append(Check(pid, rw, False, str(exc)))
    return out


def installed_reader() -> Callable[[str], str]:
    try:
        return sources.installed_reader()
    except OSError as exc:
        raise AnchorError(str(exc)) from None


def wheel_reader(wheel: str) -> Callable[[str], str]:
    return sources.wheel_reader(wheel)


def hashes(version: str, read: Callable[[str], str]) -> list[tuple[str, str, str]]:
    """(patch id, target, sha256 of the pristine function) for each rewrite of ``version``."""
    out = []
    for pid, rw in all_rewrites(version):
        located = rewrite.locate(read(rw.path), rw.target.qualname, str(rw.target))
        out.append((pid, str(rw.target), rewrite.sha256(located.source)))
    return out
