"""The README's generated tables: patches and support matrix (from the PatchSpecs), settings
(from settings.py), the token-budget priority (from budget.py). `scripts/readme_tables.py`
writes them; tests/test_readme_tables.py keeps the committed README equal to what this renders."""

from __future__ import annotations

import re

from vllm_overlay import budget, levels, matrix, settings, versions

SECTIONS = ("patches", "support-matrix", "support-levels", "settings", "budget-priority")


def patches_table() -> str:
    rows = ["| id | default | platforms | mechanism | applies on | upstream-merged on | what it does |",
            "|---|---|---|---|---|---|---|"]
    for s in matrix.specs():
        default = s.default_text()
        merged = [v for v in versions.RELEASES if (r := s.support_for(v)) and r.status == "upstream-merged"]
        rows.append(f"| `{s.id}` | {default} | {', '.join(s.platforms)} | {s.mechanism} | {s.vllm} | "
                    f"{versions.compact(merged) or '-'} | {s.title} |")
    return "\n".join(rows) + "\n"


LEVEL_SHORT = {"gpu-proven": "**GPU**", "cpu-proven": "**CPU**", "source-checked": "src"}


def _short(spec: object, version: str, runner: str, platform: str) -> str:
    c = levels.cell(spec, version, runner, platform)  # type: ignore[arg-type]
    if c.level != "unsupported":
        return LEVEL_SHORT[c.level]
    row = spec.support_for(version)  # type: ignore[attr-defined]
    return matrix.SHORT.get(row.status, "-") if row and row.status != "applies" else "-"


def levels_table() -> str:
    """Releases x patches per platform and runner, consecutive releases with the same levels in one
    row; then what proves each proven cell (result files with their dates, engine tests)."""
    specs = matrix.specs()
    rows = ["| vLLM | platform, runner | " + " | ".join(f"`{s.id}`" for s in specs) + " |",
            "|---|---|" + "---|" * len(specs)]
    for platform in levels.PLATFORMS:
        for runner in levels.RUNNERS:
            groups: list[tuple[list[str], list[str]]] = []
            for v in versions.RELEASES:
                row = [_short(s, v, runner, platform) for s in specs]
                if groups and groups[-1][1] == row:
                    groups[-1][0].append(v)
                else:
                    groups.append(([v], row))
            for vs, row in groups:
                rows.append(f"| {versions.compact(vs)} | {platform.upper() if platform == 'cpu' else 'CUDA'} {runner} | "
                            + " | ".join(row) + " |")
    rows.append("")
    proof: dict[tuple[str, str, str, str], list[str]] = {}
    for (pid, v, runner, platform), c in levels.proven_cells().items():
        for e in c["evidence"]:
            proof.setdefault((v, platform, runner, levels.evidence_text({k: e[k] for k in ("file", "date", "test")
                                                                          if k in e})), []).append(pid)
    order = {s.id: i for i, s in enumerate(specs)}
    for (v, platform, runner, what), pids in sorted(proof.items(), key=lambda kv: (
            versions.RELEASES.index(kv[0][0]), kv[0][1], kv[0][2], kv[0][3])):
        ids = ", ".join(f"`{p}`" for p in sorted(set(pids), key=order.__getitem__))
        rows.append(f"- {v} {'CUDA' if platform == 'cuda' else 'CPU'} {runner}: `{what.split(' (')[0]}`"
                    + (f" ({what.split(' (', 1)[1]}" if " (" in what else "") + f": {ids}")
    return "\n".join(rows) + "\n"


def _default(st: settings.Setting) -> str:
    if st.name == "VLLM_OVERLAY_REPORT_DIR":
        return "`$TMPDIR/vllm-overlay-reports`"
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


def render(section: str) -> str:
    if section == "patches":
        return patches_table()
    if section == "support-matrix":
        return matrix.markdown()
    if section == "support-levels":
        return levels_table()
    if section == "settings":
        return settings_table()
    if section == "budget-priority":
        return f"Token budget priority (`vllm_overlay.budget`): {budget.priority_text()}.\n"
    raise KeyError(section)


def begin(section: str) -> str:
    return f"<!-- generated {section}: scripts/readme_tables.py writes it; edit the source, not this -->"


def end(section: str) -> str:
    return f"<!-- end generated {section} -->"


def update(text: str) -> str:
    """``text`` with every generated section re-rendered. Raises if a section's markers are missing."""
    for section in SECTIONS:
        pattern = re.compile(re.escape(begin(section)) + r"\n.*?" + re.escape(end(section)), re.S)
        if not pattern.search(text):
            raise KeyError(f"README: markers of the generated section {section!r} are missing")
        text = pattern.sub(lambda _m: f"{begin(section)}\n{render(section)}{end(section)}", text)
    return text
