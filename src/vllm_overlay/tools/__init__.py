"""The tools: the `vllm-overlay` command (cli/), the stress harness (stress/), fused-MoE tuning (tune/),
the support-matrix sweep (matrix.py, wheels.py), the generated docs (docs.py), terminal output
(output.py, progress.py: rich, the ``tools`` extra, when installed) and the tiny model (models/).

They import the runtime (everything else of ``vllm_overlay``); the runtime, which every vLLM process
loads, never imports them (tests/test_layers.py)."""
