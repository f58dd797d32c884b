"""Write (or with --check, compare) the generated sections of the README and the docs pages:
the patches table and the CUDA rows of the support levels (README.md), the support matrix, the
levels of every platform and their evidence (docs/support.md), the settings table and the token-budget priority (docs/settings.md), and the
generated block of every patch's page (docs/patches/ID.md; a missing page is created with empty
hand-written sections). vllm_overlay.tools.docs renders them from the specs, the levels and the settings."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

from vllm_overlay.tools import docs  # noqa: E402


def main() -> int:
    if "--check" in sys.argv[1:]:
        problems = docs.check(ROOT)
        for line in problems:
            print(line, file=sys.stderr)
        return 1 if problems else 0
    for rel in docs.write(ROOT):
        print(f"{rel}: generated sections rewritten")
    _want, problems = docs.expected(ROOT)
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
