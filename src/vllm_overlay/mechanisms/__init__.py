"""The two ways a patch changes vLLM in memory: wrapping (wrapt) and anchored source rewrite."""
