"""DeviceOps' readings of the caching allocator on a real GPU: the free pieces of partly used
segments (fragments) against the whole free segments, which the allocator can give back to the
driver when an allocation finds no room."""

from __future__ import annotations

import pytest
import torch

from tidal.device import DeviceOps

MiB = 1 << 20


@pytest.mark.gpu
def test_fragmented_free_bytes_counts_the_free_pieces_of_partly_used_segments_only():
    ops = DeviceOps("cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base_frag, base_cached = ops.fragmented_free_bytes(), ops.cached_free_bytes()
    big = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    del big  # a whole free segment: cached, not fragmented
    assert ops.cached_free_bytes() - base_cached >= 512 * MiB
    assert ops.fragmented_free_bytes() - base_frag < 2 * MiB
    small = torch.empty(100 * MiB, dtype=torch.uint8, device="cuda")  # splits the free segment
    frag = ops.fragmented_free_bytes() - base_frag
    assert 400 * MiB <= frag <= 412 * MiB + 2 * MiB, frag / MiB
    assert ops.fragmented_free_bytes() <= ops.cached_free_bytes()
    del small  # the segment is whole and free again
    assert ops.fragmented_free_bytes() - base_frag < 2 * MiB
    torch.cuda.empty_cache()
