"""A frozen role on the GPU: the offload after the first releases device memory at driver
level without a copy, and the role comes back bit-exact."""

from __future__ import annotations

import pytest
import torch

import tidal

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_frozen_role_skips_its_copy_and_frees_memory_at_the_driver():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).cuda()  # 512 MiB
    want = {k: v.clone() for k, v in ref.state_dict().items()}
    ts = tidal.Timeshare("cuda")
    ts.add_role("reference", model=ref, frozen=True)
    nbytes = ts.role_bytes("reference")
    ts.offload("reference")  # the first trip out copies
    assert ts.records[-1].bytes_out == nbytes
    for _ in range(3):
        ts.load("reference")
        free_in = torch.cuda.mem_get_info()[0]
        ts.offload("reference")
        rec = ts.records[-1]
        assert rec.bytes_skipped == nbytes and rec.bytes_out == 0
        assert torch.cuda.mem_get_info()[0] - free_in >= nbytes - (64 << 20)  # given back to the driver
    ts.load("reference")
    assert all(torch.equal(v, want[k]) for k, v in ref.state_dict().items())
    ts.close()
