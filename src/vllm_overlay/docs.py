"""The README's generated tables: patches and support matrix (from the PatchSpecs), settings
(from settings.py), the token-budget priority (from budget.py). `scripts/readme_tables.py`
writes them; tests/test_readme_tables.py keeps the committed README equal to what this renders."""

from __future__ import annotations

import re

from vllm_overlay import budget, matrix, settings, versions

SECTIONS = ("patches", "support-matrix", "settings", "budget-priority")


def patches_table() -> str:
    rows = ["| id | default | platforms | mechanism | applies on | upstream-merged on | what it does |",
            "|---|---|---|---|---|---|---|"]
    for s in matrix.specs():
        default = s.default_text()
        merged = [v for v in versions.RELEASES if (r := s.support_for(v)) and r.status == "upstream-merged"]
        rows.append(f"| `{s.id}` | {default} | {', '.join(s.platforms)} | {s.mechanism} | {s.vllm} | "
                    f"{versions.compact(merged) or '-'} | {s.title} |")
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
