"""A step's compute floor: its matmul FLOPs (:func:`tidal.plan.step_flops`) over the matmul
rate this device reaches, measured here."""

from __future__ import annotations

import time

import torch

__all__ = ["matmul_rate"]


def matmul_rate(device: str | torch.device, dtype: torch.dtype, *, n: int | None = None, reps: int = 5) -> float:
    """FLOP/s of an ``n`` x ``n`` by ``n`` x ``n`` matmul in ``dtype`` on ``device`` (best of
    ``reps`` after a warm-up): about the best rate the device's matmuls reach, so a floor from
    it is a lower bound. ``n`` defaults to 8192 on an accelerator, 1024 on the CPU.
    Memory: three ``n`` x ``n`` matrices for the duration of the call."""
    device = torch.device(device)
    accel = device.type != "cpu"
    n = n or (8192 if accel else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)

    def sync() -> None:
        if accel:
            torch.accelerator.synchronize(device)

    torch.matmul(a, b, out=out)  # warm-up: kernel selection, workspaces
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.matmul(a, b, out=out)
        sync()
        best = min(best, time.perf_counter() - t0)
    del a, b, out
    return 2 * n**3 / best
