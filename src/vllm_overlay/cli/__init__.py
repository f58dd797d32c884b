"""The `vllm-overlay` command's former module path, kept for console scripts installed before the
tools moved to ``vllm_overlay.tools`` (an editable install's ``bin/vllm-overlay`` imports
``vllm_overlay.cli.main``). New installs run ``vllm_overlay.tools.cli.main:main``; nothing of the
runtime imports this package."""
