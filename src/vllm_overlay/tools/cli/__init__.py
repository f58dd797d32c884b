"""The `vllm-overlay` command line."""
