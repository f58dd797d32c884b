"""`vllm-overlay tune-moe`: tune vLLM's fused-MoE Triton configs on the user's own GPU."""
