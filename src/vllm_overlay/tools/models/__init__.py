"""Model configs shipped with the package (config.json only; weights come from load_format=dummy)."""

from __future__ import annotations

import os

HERE = os.path.dirname(os.path.abspath(__file__))


def tiny_hybrid_dir() -> str:
    """Directory of the tiny Qwen3-Next hybrid (3 GDN + 1 full-attention layer, 4 experts)."""
    return os.path.join(HERE, "tiny-hybrid")
