"""What the tuning commands need before any kernel: torch with a usable CUDA GPU."""

from __future__ import annotations


def torch_cuda_problem() -> str | None:
    """None when torch imports and sees a CUDA GPU; else why not, in one clause."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        return f"torch cannot be imported ({exc})"
    if not torch.cuda.is_available():
        return (f"torch.cuda.is_available() is False (torch {torch.__version__}"
                f"{', a CPU build' if '+cpu' in torch.__version__ else ''})")
    return None
