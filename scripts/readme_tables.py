"""Write (or with --check, compare) the README's generated tables: patches, support matrix,
settings, token-budget priority (vllm_overlay.docs renders them from the specs and settings)."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

from vllm_overlay import docs  # noqa: E402


def main() -> int:
    path = os.path.join(ROOT, "README.md")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    new = docs.update(text)
    if "--check" in sys.argv[1:]:
        if new != text:
            print("README.md: generated tables are stale; run: python scripts/readme_tables.py", file=sys.stderr)
            return 1
        return 0
    if new != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
        print("README.md: generated tables rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
