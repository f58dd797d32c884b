"""PatchSpec: what a patch is, declared as data. The ledger (`vllm-overlay plan`) is generated from it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Target:
    """One place a patch changes: ``module`` + ``qualname`` for the vLLM versions in ``vllm``."""

    module: str
    qualname: str
    vllm: str = ""  # PEP 440 specifier; "" = every version the patch supports

    def __str__(self) -> str:
        return f"{self.module}:{self.qualname}"


@dataclass(frozen=True)
class Edit:
    """One anchored replacement in a source rewrite: ``anchor`` must occur exactly once."""

    anchor: str
    replacement: str


@dataclass(frozen=True)
class Rewrite:
    """An in-memory source rewrite of one function for one exact vLLM version.

    ``path`` is the file relative to the vllm package (for the textual check against a wheel),
    ``sha256`` the hash of the pristine function source (its lines as in the file).
    """

    target: Target
    version: str
    path: str
    sha256: str
    edits: tuple[Edit, ...]


@dataclass(frozen=True)
class PatchSpec:
    id: str  # stable kebab-case id
    title: str
    why: str  # a paragraph
    upstream: str  # link to the upstream issue / PR / code
    targets: tuple[Target, ...]
    mechanism: str  # "wrap" | "rewrite" | "wrap+rewrite"
    vllm: str  # PEP 440 specifier of the supported vLLM versions
    default: bool  # on unless disabled
    retire_when: str
    requires: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = ()
    settings: tuple[str, ...] = ()  # names of the settings it reads
    platforms: tuple[str, ...] = ("cuda", "cpu")
    enabled_by: str | None = None  # a setting whose non-zero value turns the patch on
    upstream_merged: str = ""  # vLLM versions where upstream already does this
    changes_traced_code: bool = False  # must change vLLM's compile-cache key
    rewrites: tuple[Rewrite, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.id or not all(p.isalnum() and p == p.lower() for p in self.id.split("-")):
            raise ValueError(f"PatchSpec.id={self.id!r}: expected kebab-case (a-z, 0-9, '-')")
        if self.mechanism not in ("wrap", "rewrite", "wrap+rewrite"):
            raise ValueError(
                f"PatchSpec.mechanism={self.mechanism!r}: expected 'wrap', 'rewrite' or 'wrap+rewrite'"
            )
