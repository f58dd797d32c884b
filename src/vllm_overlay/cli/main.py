"""``vllm_overlay.cli.main:main``, the console script of installs made before the tools moved: the same
command as ``vllm_overlay.tools.cli.main:main`` (reinstalling writes a script that names that one)."""

from vllm_overlay.tools.cli.main import main

__all__ = ["main"]
