"""Triton kernels of vllm-overlay (imported only where Triton and a GPU are present)."""
