"""The support matrix: for every release of ``versions.RELEASES`` and every patch, what the patch
does there (its PatchSpec's support row) and the sweep that proves it against that release's
sources (a wheel or the installed vLLM), without importing vLLM:

- every wrap target that applies exists (``module:qualname``, a method possibly inherited) and
  has the parameters its wrapper reads;
- every rewrite target has a rewrite recorded for the release, whose pristine hash matches and
  whose anchors occur exactly once;
- the support row's proofs hold (text present or absent in a file).

What the specs' data alone must satisfy (support rows covering every release once, target ranges,
the releases rewrites are recorded for) is ``spec.version_problems``, checked when the registry
loads, before any sweep.

``propose`` computes what a maintainer adds to the specs for a release not in the matrix yet.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vllm_overlay import versions
from vllm_overlay.errors import AnchorError
from vllm_overlay.mechanisms import rewrite
from vllm_overlay.sources import Reader, find
from vllm_overlay.spec import PatchSpec, Rewrite


def specs() -> tuple[PatchSpec, ...]:
    from vllm_overlay.core import specs as core_specs

    return core_specs()


@dataclass(frozen=True)
class Cell:
    version: str
    patch_id: str
    status: str  # applies / upstream-merged / not-needed / unsupported
    reason: str


def cells(version: str) -> list[Cell]:
    out = []
    for spec in specs():
        row = spec.support_for(version)
        out.append(Cell(version, spec.id, row.status, row.reason) if row else
                   Cell(version, spec.id, "unsupported", "no support row covers this release"))
    return out


# ---- the sweep ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    version: str
    patch_id: str
    what: str  # "target", "rewrite", "proof"
    subject: str
    ok: bool
    detail: str


def _check_target(version: str, spec: PatchSpec, t, read: Reader) -> Check:  # type: ignore[no-untyped-def]
    if t.module != "vllm" and not t.module.startswith("vllm."):
        # not in the vLLM wheel (e.g. prometheus_client): the support row's proofs show vLLM uses it
        return Check(version, spec.id, "target", str(t), True,
                     "outside vLLM: not in the wheel; the support row's proofs back it")
    try:
        found = find(t.module, t.qualname, read)
    except (KeyError, SyntaxError) as exc:
        return Check(version, spec.id, "target", str(t), False, f"missing: {exc}")
    where = f"vllm/{found.path}:{found.line}"
    if (found.module, found.qualname) != (t.module, t.qualname):
        where += f" (inherited from {found.module}:{found.qualname})"
    missing = [p for p in t.params if p not in found.params]
    if missing:
        return Check(version, spec.id, "target", str(t), False,
                     f"defined at {where} but without parameter(s) {', '.join(missing)} that {t.wrapper_name} reads")
    return Check(version, spec.id, "target", str(t), True, f"defined at {where}")


def _check_rewrite(version: str, spec: PatchSpec, rw: Rewrite, read: Reader) -> Check:
    try:
        found = find(rw.target.module, rw.target.qualname, read)
    except (KeyError, SyntaxError) as exc:
        return Check(version, spec.id, "rewrite", str(rw.target), False, f"missing: {exc}")
    if found.path != rw.path or found.qualname != rw.target.qualname:
        return Check(version, spec.id, "rewrite", str(rw.target), False,
                     f"defined in vllm/{found.path} as {found.qualname}, but the rewrite reads vllm/{rw.path}")
    try:
        new = rewrite.check_text(rw, read(rw.path))
    except AnchorError as exc:
        return Check(version, spec.id, "rewrite", str(rw.target), False, str(exc))
    left = [g for g in rw.gone if g in new]
    if left:
        return Check(version, spec.id, "rewrite", str(rw.target), False,
                     f"hash and anchors match, but the rewritten function still contains {left[0]!r} "
                     "(the release added another occurrence: a new edit is needed)")
    return Check(version, spec.id, "rewrite", str(rw.target), True,
                 f"sha256 {rw.sha256[:12]} and {len(rw.edits)} anchor(s), each once"
                 + (f"; no {rw.gone[0]!r} left" if rw.gone else ""))


def sweep(version: str, read: Reader) -> list[Check]:
    """Every check of every patch for ``version`` against its sources (``read``)."""
    out: list[Check] = []
    for spec in specs():  # their version facts were checked when the registry loaded (spec.version_problems)
        row = spec.support_for(version)
        if row is None:
            continue
        for proof in row.proof:
            try:
                text = read(proof.path)
            except (OSError, KeyError) as exc:
                out.append(Check(version, spec.id, "proof", proof.path, False, f"cannot read: {exc}"))
                continue
            ok = (proof.text in text) == proof.present
            word = "contains" if proof.present else "does not contain"
            out.append(Check(version, spec.id, "proof", f"vllm/{proof.path}", ok,
                             f"{'' if ok else 'expected: '}{word} {proof.text!r}"))
        if not spec.applies_on(version):
            continue
        for t in spec.wrap_targets(version):
            out.append(_check_target(version, spec, t, read))
        for rw in spec.rewrites_for(version):
            out.append(_check_rewrite(version, spec, rw, read))
    return out


# ---- proposing entries for a new release -----------------------------------------------------------


def _latest(spec: PatchSpec) -> str | None:
    applied = spec.releases()
    return applied[-1] if applied else None


def propose(version: str, read: Reader) -> list[str]:
    """Lines a maintainer reads to add ``version``: each rewrite's pristine hash with its anchors
    checked against the edits of the latest recorded release, each wrap target's existence, each
    support row's proofs. Nothing is written; nothing is assumed to hold that was not checked."""
    lines = [f"vLLM {version}: entries to add (computed from its sources; review before committing)"]
    if version not in versions.RELEASES:
        lines.append(f"versions.RELEASES: add {version!r}")
    for spec in specs():
        latest = _latest(spec)
        merged = [v for v in versions.RELEASES if not spec.applies_on(v)]
        if latest is None or (merged and versions.RELEASES.index(merged[-1]) > versions.RELEASES.index(latest)):
            last = merged[-1] if merged else None
            row = spec.support_for(last) if last else None
            if row is not None:
                held = all((p.text in _safe(read, p.path)) == p.present for p in row.proof)
                lines.append(f"{spec.id}: {row.status} on {last}; its proofs "
                             f"{'hold' if held else 'DO NOT hold'} on {version}"
                             + (f": extend Support({row.vllm!r}, {row.status!r}, ...) to {version}" if held else
                                ": read the sources and decide"))
            continue
        problems = 0
        for t in spec.wrap_targets(latest):
            c = _check_target(version, spec, t, read)
            problems += not c.ok
            lines.append(f"{spec.id}: target {t}: {'ok' if c.ok else 'MISSING'}: {c.detail}")
        seen: set[tuple[str, str]] = set()
        for rw in reversed(spec.rewrites_for(latest)):
            key = (rw.target.module, rw.target.qualname)
            if key in seen:
                continue
            seen.add(key)
            lines.append(_propose_rewrite(spec, rw, version, read))
            problems += "DRIFT" in lines[-1] or "MISSING" in lines[-1]
        row = spec.support_for(latest)
        assert row is not None
        for p in row.proof:
            ok = (p.text in _safe(read, p.path)) == p.present
            problems += not ok
            lines.append(f"{spec.id}: proof vllm/{p.path} {'contains' if p.present else 'lacks'} "
                         f"{p.text!r}: {'holds' if ok else 'DOES NOT hold'}")
        lines.append(f"{spec.id}: " + (f"extend Support({row.vllm!r}, 'applies', ...) to {version}" if not problems
                                       else f"{problems} problem(s): do not add {version} before they are resolved"))
    return lines


def _safe(read: Reader, path: str) -> str:
    try:
        return read(path)
    except (OSError, KeyError):
        return ""


def _propose_rewrite(spec: PatchSpec, rw: Rewrite, version: str, read: Reader) -> str:
    name = f"{spec.id}: rewrite {rw.target.qualname}"
    candidates = [rw.target.module] + sorted({r.target.module for r in spec.rewrites
                                               if r.target.qualname == rw.target.qualname} - {rw.target.module})
    for module in candidates:
        try:
            found = find(module, rw.target.qualname, read)
        except (KeyError, SyntaxError):
            continue
        try:
            source = rewrite.locate(read(found.path), found.qualname, name).source
        except AnchorError as exc:
            return f"{name}: MISSING: {exc}"
        sha = rewrite.sha256(source)
        trial = replace(rw, version=version, sha256=sha, path=found.path,
                        target=replace(rw.target, module=found.module, vllm=f"=={version}"))
        try:
            new = rewrite.check_text(trial, read(found.path))
        except AnchorError as exc:
            return f"{name} in vllm/{found.path}: sha256 {sha}: DRIFT with the edits of {rw.version}: {exc}"
        left = [g for g in rw.gone if g in new]
        if left:
            return (f"{name} in vllm/{found.path}: sha256 {sha}: DRIFT with the edits of {rw.version}: the "
                    f"rewritten function still contains {left[0]!r}: a new edit is needed")
        same = " (unchanged)" if sha == rw.sha256 else ""
        return (f"{name} in vllm/{found.path}: add {version!r}: {sha!r},{same} to the per_release(...) "
                f"with the edits of {rw.version} ({len(rw.edits)} anchor(s), each once)")
    return f"{name}: MISSING in {', '.join(candidates)}: find where it moved"


# ---- rendering ---------------------------------------------------------------------------------------

SHORT = {"applies": "applies", "upstream-merged": "upstream", "not-needed": "not needed", "unsupported": "-"}


def plain_lines() -> list[str]:
    """One line per (release, patch): release, patch id, status, reason. Never wrapped."""
    ids = [s.id for s in specs()]
    width = max(map(len, ids))
    out = []
    for v in versions.RELEASES:
        for c in cells(v):
            out.append(f"{v:<7} {c.patch_id:<{width}} {c.status:<15} {c.reason}")
    return out


def markdown() -> str:
    """The support table of docs/support.md: releases x patches, then each patch's rows with reasons."""
    all_specs = specs()
    head = "| vLLM | " + " | ".join(f"`{s.id}`" for s in all_specs) + " |"
    rule = "|---|" + "---|" * len(all_specs)
    rows = [head, rule]
    for v in versions.RELEASES:
        rows.append(f"| {v} | " + " | ".join(SHORT[c.status] for c in cells(v)) + " |")
    rows.append("")
    for s in all_specs:
        for row in s.support:
            covered = [v for v in versions.RELEASES if s.support_for(v) is row]
            if covered:
                rows.append(f"- `{s.id}` {versions.compact(covered)}: {row.status}: {row.reason}")
    return "\n".join(rows) + "\n"



# ---- the proposal for a new release: what changed under each target ------------------------------


def _function_source(module: str, qualname: str, read: Reader) -> tuple[str, str]:
    """(where, source lines) of ``module:qualname`` (a method possibly inherited); KeyError if missing."""
    import ast

    found = find(module, qualname, read)
    text = read(found.path)
    body: list[ast.stmt] = ast.parse(text).body
    node: ast.AST | None = None
    for part in found.qualname.split("."):
        node = next((n for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                     and n.name == part), None)
        if node is None:
            raise KeyError(f"{found.module}:{found.qualname}: no definition of {part} in vllm/{found.path}")
        body = getattr(node, "body", [])
    assert node is not None
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])  # type: ignore[attr-defined]
    source = "".join(text.splitlines(keepends=True)[first - 1: node.end_lineno])  # type: ignore[attr-defined]
    return f"vllm/{found.path}:{node.lineno} ({found.module}:{found.qualname})", source  # type: ignore[attr-defined]


def target_diffs(spec: PatchSpec, version: str, read: Reader, base: str, read_base: Reader) -> list[str]:
    """For each vLLM function ``spec`` wraps or rewrites on its newest release in the matrix: the unified
    diff of its source in ``base`` (the newest release of the matrix, ``read_base``) against ``version``
    (``read``), or that it is unchanged, missing, or outside vLLM. Markdown lines."""
    import difflib

    latest = _latest(spec)
    if latest is None:
        return [f"- `{spec.id}`: applies on no release of the matrix: no target to compare"]
    seen: set[tuple[str, str]] = set()
    out: list[str] = []
    for t in [t for t in spec.targets if t.applies_to(latest)]:
        key = (t.module, t.qualname)
        if key in seen:
            continue
        seen.add(key)
        if t.module != "vllm" and not t.module.startswith("vllm."):
            out.append(f"- `{spec.id}` `{t}`: outside vLLM, not in the wheels")
            continue
        try:
            where_old, old = _function_source(t.module, t.qualname, read_base)
        except (KeyError, SyntaxError) as exc:
            out.append(f"- `{spec.id}` `{t}`: not found in {base} ({exc}): nothing to compare")
            continue
        try:
            where_new, new = _function_source(t.module, t.qualname, read)
        except (KeyError, SyntaxError) as exc:
            out.append(f"- `{spec.id}` `{t}`: MISSING in {version}: {exc}")
            continue
        if old == new:
            out.append(f"- `{spec.id}` `{t}`: unchanged from {base} ({where_new})")
            continue
        diff = difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                    f"{base} {where_old}", f"{version} {where_new}")
        out += [f"- `{spec.id}` `{t}`: CHANGED from {base}:", "", "```diff", *(ln.rstrip("\n") for ln in diff),
                "```", ""]
    return out


def proposal(version: str, read: Reader, base: str, read_base: Reader) -> str:
    """The proposal a maintainer reviews before adding ``version`` (`vllm-overlay verify --version X
    --propose --out FILE`): per patch, the support row to extend or the checks that fail, then each
    target's source diffed against ``base``, the newest release of the matrix. Markdown."""
    lines = propose(version, read)
    failing = [ln for ln in lines if "DOES NOT hold" in ln or "DRIFT" in ln or "MISSING" in ln]
    out = [f"# vLLM {version}: proposal for the support matrix", "",
           f"Computed from the CUDA wheels of vLLM {version} and of {base}, the newest release of the matrix. "
           "Nothing here is applied: review it, then edit the specs (CONTRIBUTING.md, Adding a vLLM release).", "",
           "## Support rows per patch", "", *(f"- {ln}" for ln in lines[1:]), "",
           "## Checks that fail", "", *([f"- {ln}" for ln in failing] or ["- none"]), "",
           f"## Each target's source against {base}", ""]
    for spec in specs():
        out += target_diffs(spec, version, read, base, read_base)
    return "\n".join(out).rstrip("\n") + "\n"
