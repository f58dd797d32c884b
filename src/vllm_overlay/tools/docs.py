"""The generated parts of the README and of the docs pages, and the check that keeps them current.

Generated sections sit between ``<!-- generated NAME: ... -->`` and ``<!-- end generated NAME -->``
markers; everything outside the markers is written by hand and kept as it is.

- the files of ``PAGES`` (the README, the docs pages): the patches table and the support matrix
  (from the PatchSpecs), the support-levels table and what proves each proven cell (from
  ``vllm_overlay.levels``), the settings table (from settings.py), the token-budget priority
  (from budget.py);
- ``docs/patches/ID.md``: one page per patch, its spec's facts generated (section ``patch ID``),
  followed by the hand-written sections of ``HAND_SECTIONS``.

`scripts/readme_tables.py` writes them (a missing patch page is created with empty hand-written
sections to fill in); `scripts/readme_tables.py --check` and tests/test_docs_pages.py fail when a
generated section is stale, a patch has no page, a page names an unknown patch id, or a page's
hand-written section is missing or empty.
"""

from __future__ import annotations

import os
import re

from vllm_overlay import budget, levels, settings, versions
from vllm_overlay.tools import matrix
from vllm_overlay.spec import PatchSpec

# file (relative to the project root) -> the generated sections it holds
PAGES: dict[str, tuple[str, ...]] = {
    "README.md": ("patches", "support-levels-cuda"),
    "docs/support.md": ("support-matrix", "support-levels", "support-evidence"),
    "docs/settings.md": ("settings", "budget-priority"),
}
PATCH_DIR = "docs/patches"
HAND_SECTIONS = ("## Why", "## How", "## What was measured")


def patches_table() -> str:
    rows = ["| id | default | platforms | mechanism | applies on | upstream-merged on | what it does |",
            "|---|---|---|---|---|---|---|"]
    for s in matrix.specs():
        default = s.default_text()
        merged = s.releases("upstream-merged")
        rows.append(f"| [`{s.id}`]({PATCH_DIR}/{s.id}.md) | {default} | {', '.join(s.platforms)} | {s.mechanism} | "
                    f"{s.vllm} | {versions.compact(merged) or '-'} | {s.title} |")
    return "\n".join(rows) + "\n"


LEVEL_SHORT = {"gpu-proven": "**GPU**", "cpu-proven": "**CPU**", "source-checked": "src"}


def _where(platform: str, runner: str) -> str:
    return f"{'CPU' if platform == 'cpu' else 'CUDA'} {runner}"


def _short(spec: object, version: str, runner: str, platform: str) -> str:
    c = levels.cell(spec, version, runner, platform)  # type: ignore[arg-type]
    if c.level != "unsupported":
        return LEVEL_SHORT[c.level]
    row = spec.support_for(version)  # type: ignore[attr-defined]
    return matrix.SHORT.get(row.status, "-") if row and not spec.applies_on(version) else "-"  # type: ignore[attr-defined]


def levels_table(platforms: tuple[str, ...] = levels.PLATFORMS) -> str:
    """Releases x patches per platform and runner, consecutive releases with the same levels in one row
    (the README's table: the CUDA rows; docs/support.md's: every platform)."""
    specs = matrix.specs()
    rows = ["| vLLM | platform, runner | " + " | ".join(f"`{s.id}`" for s in specs) + " |",
            "|---|---|" + "---|" * len(specs)]
    for platform in platforms:
        for runner in levels.RUNNERS:
            groups: list[tuple[list[str], list[str]]] = []
            for v in (v for v in versions.RELEASES if levels.runner_exists(v, runner)):
                row = [_short(s, v, runner, platform) for s in specs]
                if groups and groups[-1][1] == row:
                    groups[-1][0].append(v)
                else:
                    groups.append(([v], row))
            for vs, row in groups:
                rows.append(f"| {versions.compact(vs)} | {_where(platform, runner)} | " + " | ".join(row) + " |")
    return "\n".join(rows) + "\n"


def _evidence_lines(only: str | None = None) -> list[str]:
    """One line per proven cell's evidence item (a result file with its date, an engine test) and
    the patches it proves there; ``only``: the lines of that patch, without the patch list."""
    specs = matrix.specs()
    proof: dict[tuple[str, str, str, str], list[str]] = {}
    for (pid, v, runner, platform), c in levels.proven_cells().items():
        if only is not None and pid != only:
            continue
        for e in c["evidence"]:
            proof.setdefault((v, platform, runner, levels.evidence_text({k: e[k] for k in ("file", "date", "test")
                                                                          if k in e})), []).append(pid)
    order = {s.id: i for i, s in enumerate(specs)}
    out = []
    for (v, platform, runner, what), pids in sorted(proof.items(), key=lambda kv: (
            versions.RELEASES.index(kv[0][0]), kv[0][1], kv[0][2], kv[0][3])):
        line = (f"- {v} {_where(platform, runner)}: `{what.split(' (')[0]}`"
                + (f" ({what.split(' (', 1)[1]}" if " (" in what else ""))
        if only is None:
            line += ": " + ", ".join(f"`{p}`" for p in sorted(set(pids), key=order.__getitem__))
        out.append(line)
    return out


def levels_evidence() -> str:
    """What proves each proven cell: result files with their dates, engine tests, with the patches."""
    return "\n".join(_evidence_lines()) + "\n"


def _default(st: settings.Setting) -> str:
    if st.name == "VLLM_OVERLAY_REPORT_DIR":
        return "`$TMPDIR/vllm-overlay-reports-UID`"
    if st.default is None or st.default == ():
        return "-"
    if isinstance(st.default, bool):
        return "1" if st.default else "0"
    return str(st.default)


def settings_table() -> str:
    rows = ["| variable | default | accepted | meaning |", "|---|---|---|---|"]
    for st in settings.SETTINGS:
        name = f"`{st.name}`" + (f" (alias `{'`, `'.join(st.aliases)}`)" if st.aliases else "")
        meaning = ("**test only.** " if st.test_only else "") + st.help.replace("|", "\\|")
        rows.append(f"| {name} | {_default(st)} | {st.accepted.replace('|', chr(92) + '|')} | {meaning} |")
    return "\n".join(rows) + "\n"


# ---- one page per patch ---------------------------------------------------------------------------


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _target_line(spec: PatchSpec, t: object) -> str:
    rewritten = [rw.version for rw in spec.rewrites
                 if (rw.target.module, rw.target.qualname) == (t.module, t.qualname)  # type: ignore[attr-defined]
                 and t.applies_to(rw.version)]  # type: ignore[attr-defined]
    how = []
    if t.wrapper:  # type: ignore[attr-defined]
        how.append(f"wrapped (`{t.wrapper_name}`)")  # type: ignore[attr-defined]
    if rewritten:
        how.append(f"rewritten in memory on {versions.compact(rewritten)} (pristine hash and anchors checked)")
    where = [f"vLLM `{t.vllm}`" if t.vllm else "every release it applies on"]  # type: ignore[attr-defined]
    if t.platform:  # type: ignore[attr-defined]
        where.append(f"{t.platform} only")  # type: ignore[attr-defined]
    params = f"; reads {', '.join(f'`{p}`' for p in t.params)}" if t.params else ""  # type: ignore[attr-defined]
    return f"- `{t}`: {' and '.join(how)}; {', '.join(where)}{params}"


def _levels_rows(spec: PatchSpec) -> list[str]:
    rows = ["| platform, runner | " + " | ".join(reversed(levels.LEVELS)) + " (does nothing there) |",
            "|---|" + "---|" * len(levels.LEVELS)]
    for platform in levels.PLATFORMS:
        for runner in levels.RUNNERS:
            by: dict[str, list[str]] = {}
            for v in (v for v in versions.RELEASES if levels.runner_exists(v, runner)):
                by.setdefault(levels.cell(spec, v, runner, platform).level, []).append(v)
            rows.append(f"| {_where(platform, runner)} | "
                        + " | ".join(versions.compact(by[lv]) if lv in by else "-" for lv in reversed(levels.LEVELS))
                        + " |")
    return rows


def patch_page(spec: PatchSpec) -> str:
    """The generated block of docs/patches/ID.md: the spec's facts, its support rows, its levels."""
    merged = spec.releases("upstream-merged")
    facts = [("id", f"`{spec.id}`"), ("default", spec.default_text()), ("platforms", ", ".join(spec.platforms)),
             ("mechanism", spec.mechanism), ("applies on", spec.vllm),
             ("upstream-merged on", versions.compact(merged) or "-"),
             ("settings it reads", ", ".join(f"`{n}`" for n in spec.settings) or "-")]
    if spec.requires:
        facts.append(("requires", ", ".join(f"`{r}`" for r in spec.requires)))
    if spec.conflicts:
        facts.append(("conflicts with", ", ".join(f"`{r}`" for r in spec.conflicts)))
    if spec.shown_by:
        facts.append(("report counters that show it acted", ", ".join(f"`{c}`" for c in spec.shown_by)))
    facts += [("upstream", _cell(spec.upstream)), ("retire when", _cell(spec.retire_when)),
              ("beyond the matrix", _cell(("carries over where its checks hold: " if spec.beyond_matrix == "carry"
                                          else "never applies: " if spec.beyond_matrix == "never" else "undeclared: ")
                                         + spec.beyond_matrix_why))]
    out = [f"# `{spec.id}`: {spec.title}", "",
           "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in facts), "",
           "What the spec says (`vllm-overlay plan --ledger` prints the same):", ""]
    out += [("> " + line).rstrip() for line in spec.why.strip().splitlines()]
    out += ["", "Targets:", "", *(_target_line(spec, t) for t in spec.targets), "",
            "Support rows (`vllm-overlay matrix`; `vllm-overlay verify` checks each row's proofs in that "
            "release's wheel):", "", "| vLLM | status | reason |", "|---|---|---|"]
    for row in spec.support:
        covered = [v for v in versions.RELEASES if spec.support_for(v) is row]
        if covered:
            out.append(f"| {versions.compact(covered)} | {row.status} | {_cell(row.reason)} |")
    out += ["", "Support levels of its cells (`vllm_overlay.levels`; [what the levels mean](../support.md)):", "",
            *_levels_rows(spec), ""]
    evidence = _evidence_lines(only=spec.id)
    out += (["What proves its proven cells:", "", *evidence] if evidence
            else ["No cell of this patch is proven by a run yet."])
    return "\n".join(out) + "\n"


def patch_skeleton(spec: PatchSpec) -> str:
    """A new page: the generated block, then the hand-written sections, empty."""
    section = f"patch {spec.id}"
    hand = "\n\n".join(HAND_SECTIONS)
    return f"{begin(section)}\n{patch_page(spec)}{end(section)}\n\n{hand}\n"


# ---- rendering and checking -------------------------------------------------------------------------


def render(section: str) -> str:
    if section == "patches":
        return patches_table()
    if section == "support-matrix":
        return matrix.markdown()
    if section == "support-levels":
        return levels_table()
    if section == "support-levels-cuda":
        return levels_table(("cuda",))
    if section == "support-evidence":
        return levels_evidence()
    if section == "settings":
        return settings_table()
    if section == "budget-priority":
        return f"Token budget priority (`vllm_overlay.budget`): {budget.priority_text()}.\n"
    if section.startswith("patch "):
        by_id = {s.id: s for s in matrix.specs()}
        return patch_page(by_id[section[len("patch "):]])
    raise KeyError(section)


def begin(section: str) -> str:
    return f"<!-- generated {section}: scripts/readme_tables.py writes it; edit the source, not this -->"


def end(section: str) -> str:
    return f"<!-- end generated {section} -->"


def update(text: str, sections: tuple[str, ...] = PAGES["README.md"], name: str = "README.md") -> str:
    """``text`` with each of ``sections`` re-rendered. Raises KeyError if a section's markers are missing."""
    for section in sections:
        pattern = re.compile(re.escape(begin(section)) + r"\n.*?" + re.escape(end(section)), re.S)
        if not pattern.search(text):
            raise KeyError(f"{name}: markers of the generated section {section!r} are missing")
        text = pattern.sub(lambda _m: f"{begin(section)}\n{render(section)}{end(section)}", text)
    return text


def _hand_problems(name: str, text: str) -> list[str]:
    """The hand-written sections of a patch page: each present once and not empty."""
    bodies: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("## ") or line.startswith("# ") or line.startswith("<!-- "):
            current = bodies.setdefault(line, []) if line in HAND_SECTIONS and line not in bodies else None
            if line in HAND_SECTIONS and current is None:
                bodies[line + " (again)"] = []
            continue
        if current is not None:
            current.append(line)
    out = []
    for head in HAND_SECTIONS:
        if head not in bodies:
            out.append(f"{name}: the hand-written section {head!r} is missing")
        elif head + " (again)" in bodies:
            out.append(f"{name}: the hand-written section {head!r} appears twice")
        elif not "".join(bodies[head]).strip():
            out.append(f"{name}: the hand-written section {head!r} is empty")
    return out


def _render(path: str, rel: str, sections: tuple[str, ...], want: dict[str, str], problems: list[str]) -> bool:
    """The file at ``path`` with ``sections`` rendered anew into ``want[rel]``; False (the reason in
    ``problems``) when its markers are missing."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        want[rel] = update(text, sections, rel)
    except KeyError as exc:
        problems.append(str(exc.args[0]))
        return False
    return True


def expected(root: str) -> tuple[dict[str, str], list[str]]:
    """What every generated file should hold (relative path -> text), and the problems no rewrite
    fixes (missing markers, a page for an unknown patch id, a hand-written section missing or empty)."""
    want: dict[str, str] = {}
    problems: list[str] = []
    for rel, sections in PAGES.items():
        path = os.path.join(root, rel)
        if not os.path.exists(path):
            problems.append(f"{rel}: missing")
            continue
        _render(path, rel, sections, want, problems)
    ids = [s.id for s in matrix.specs()]
    folder = os.path.join(root, PATCH_DIR)
    present = sorted(f[:-3] for f in os.listdir(folder) if f.endswith(".md")) if os.path.isdir(folder) else []
    for stem in present:
        if stem not in ids:
            problems.append(f"{PATCH_DIR}/{stem}.md: no patch has the id {stem!r} (known: {', '.join(ids)})")
    for spec in matrix.specs():
        rel = f"{PATCH_DIR}/{spec.id}.md"
        if spec.id not in present:
            want[rel] = patch_skeleton(spec)
            continue
        if _render(os.path.join(root, rel), rel, (f"patch {spec.id}",), want, problems):
            problems += _hand_problems(rel, want[rel])
    return want, problems


def check(root: str) -> list[str]:
    """Every reason the committed files differ from what this module renders (empty: all current)."""
    want, problems = expected(root)
    for rel, text in want.items():
        path = os.path.join(root, rel)
        if not os.path.exists(path):
            problems.append(f"{rel}: missing (every patch has a page; scripts/readme_tables.py creates it)")
            continue
        with open(path, encoding="utf-8") as f:
            if f.read() != text:
                problems.append(f"{rel}: generated sections are stale; run: python scripts/readme_tables.py")
    return problems


def write(root: str) -> list[str]:
    """Rewrite every stale generated section, create missing patch pages; returns the files written."""
    want, _problems = expected(root)
    written = []
    for rel, text in want.items():
        path = os.path.join(root, rel)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                if f.read() == text:
                    continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        written.append(rel)
    return written
