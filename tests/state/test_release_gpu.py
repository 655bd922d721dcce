"""Releasing to the driver frees segments that only cuBLAS's cached workspace kept."""

import pytest
import torch

from tidal.device import DeviceOps

MiB = 1 << 20


@pytest.mark.gpu
def test_release_to_driver_drops_blas_workspaces_that_pin_segments():
    ops = DeviceOps("cuda")
    ops.release_to_driver()  # no workspace cached: the next matmul allocates a new one
    # What other owners (a region's pool, a live tensor of an earlier test) keep reserved.
    before = torch.cuda.memory_reserved()
    big = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    del big  # a cached, free 512 MiB segment
    a = torch.randn(256, 256, device="cuda")
    (a @ a).sum().item()  # the workspace lands in the cached segment
    del a
    torch.cuda.empty_cache()
    pinned = torch.cuda.memory_reserved() - before
    assert pinned >= 512 * MiB, "setup: the workspace should have kept the 512 MiB segment"
    ops.release_to_driver()
    assert torch.cuda.memory_reserved() - before <= 64 * MiB, (before, torch.cuda.memory_reserved())
    b = torch.randn(256, 256, device="cuda")
    assert torch.equal(b @ b, b @ b)  # matmuls still work: the workspace comes back lazily
