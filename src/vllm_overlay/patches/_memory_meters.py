"""memory-headroom's meters: one number space per platform (the caching allocator's bytes on CUDA,
the process's resident set on the CPU build), read the same way by the correction and the watch."""

from __future__ import annotations

from typing import Any


class MeterUnavailable(RuntimeError):
    """This platform cannot measure a peak here (said once, nothing is corrected)."""


class CudaMeter:
    """The caching allocator's allocated bytes on one device (what vLLM's profiling reads)."""

    name = "torch.cuda allocated bytes"
    whole_process = False  # counts tensors only: a runtime peak above the reservation is the forwards'

    def __init__(self, device: Any) -> None:
        self.device = device

    def current(self) -> int:
        import torch

        return int(torch.cuda.memory_allocated(self.device))

    def reset_peak(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        import torch

        return int(torch.cuda.max_memory_allocated(self.device))

    def peak_reserved(self) -> int:
        """What the caching allocator held from the device at most since the last reset (its tensors and
        the blocks it keeps without handing them out): the device sees this, not the allocated peak."""
        import torch

        return int(torch.cuda.max_memory_reserved(self.device))

    def sync(self) -> None:
        import torch

        torch.cuda.synchronize(self.device)

    def non_torch(self) -> int:
        """Device memory in use that the caching allocator does not hold (NCCL, cuBLAS, ...)."""
        import torch

        free, total = torch.cuda.mem_get_info(self.device)
        return int(total - free - torch.cuda.memory_reserved(self.device))


class RssMeter:
    """The process's resident set (what the CPU worker subtracts from its requested memory):
    VmRSS now, VmHWM since the last reset (writing 5 to /proc/self/clear_refs resets it)."""

    name = "resident set (VmRSS / VmHWM)"
    # the whole process: after the KV cache exists it also counts what is no forward (the scheduler's
    # block pool, request state, modules imported, and on the CPU build with the engine core in the
    # worker's process, the caller's own objects), so a runtime peak above the reservation cannot be
    # told from that (the runtime line says so instead of an alarm)
    whole_process = True

    def __init__(self, status: str = "/proc/self/status", clear_refs: str = "/proc/self/clear_refs") -> None:
        self.status, self.clear_refs = status, clear_refs

    def _read(self, key: str) -> int:
        with open(self.status) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise MeterUnavailable(f"{self.status} has no {key} line")

    def current(self) -> int:
        return self._read("VmRSS")

    def reset_peak(self) -> None:
        try:
            with open(self.clear_refs, "w") as f:
                f.write("5")
        except OSError as exc:
            raise MeterUnavailable(f"cannot reset the peak resident set ({self.clear_refs}: {exc})") from exc

    def peak(self) -> int:
        return self._read("VmHWM")

    def sync(self) -> None:
        pass

    def non_torch(self) -> int:
        return 0  # the resident set already counts every allocation of the process


def meter_for(worker: Any) -> CudaMeter | RssMeter:
    device = getattr(worker, "device", None)
    if getattr(device, "type", None) == "cpu" or type(worker).__name__ == "CPUWorker":
        return RssMeter()
    return CudaMeter(device)


def runner_meter(runner: Any) -> CudaMeter | RssMeter:
    device = getattr(runner, "device", None)
    return RssMeter() if getattr(device, "type", None) == "cpu" else CudaMeter(device)
