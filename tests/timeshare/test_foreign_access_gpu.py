"""Issue 27 on a GPU: code that does not know tidal and reads or writes a tensor of a moved-out
role gets tidal's error naming the role and the fix, never an illegal-address fault; the CUDA
context stays usable after; an address-stable role (a region) is guarded the same way and a
CUDA graph captured over it replays bit-identically after the restore."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import tidal
from tests.helpers import is_out
from tests.timeshare.test_foreign_access import _expect_tidal_error, check_every_foreign_access

pytestmark = pytest.mark.gpu

_ISSUE_CASE = textwrap.dedent(
    """
    import torch, tidal
    torch.manual_seed(0)
    m = torch.nn.Linear(4096, 4096).cuda()
    want = m.weight.detach().cpu()
    ts = tidal.Timeshare("cuda")
    ts.add_role("a", model=m)
    ts.offload("a")
    try:
        m.weight.sum().item()
        print("NO ERROR")
    except RuntimeError as e:
        print("RAISED", str(e).splitlines()[0])
    # The CUDA context is not poisoned: the process goes on using the GPU.
    x = torch.ones(1 << 20, device="cuda")
    print("SUM", int(x.sum().item()))
    y = torch.randn(256, 256, device="cuda") @ torch.randn(256, 256, device="cuda")
    torch.cuda.synchronize()
    print("MATMUL", bool(torch.isfinite(y).all().item()))
    ts.load("a")
    print("BACK", torch.equal(m.weight.detach().cpu(), want))
    ts.close()
    """
)


def test_issue_case_linear_sum_item_raises_and_the_process_goes_on_using_the_gpu():
    """The issue's GPU case (it was cudaErrorIllegalAddress, and every later CUDA call failed),
    in a child process: a poisoned context there cannot spoil this test run."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", _ISSUE_CASE], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "RAISED tidal: role 'a' is offloaded" in out, out
    assert f"SUM {1 << 20}" in out and "MATMUL True" in out and "BACK True" in out, out


@pytest.mark.parametrize("residency", ["step", "stream", "role"])
def test_every_foreign_access_of_an_offloaded_role_raises_tidal_error_on_the_gpu(residency):
    check_every_foreign_access(residency, "cuda")
    x = torch.ones(1 << 20, device="cuda")
    assert int(x.sum().item()) == 1 << 20  # the context is fine after all those errors
    torch.cuda.synchronize()


def test_a_prefetching_role_is_guarded_until_claimed_on_the_gpu():
    a, b = nn.Linear(2048, 2048).cuda(), nn.Linear(2048, 2048).cuda()
    want = b.weight.detach().cpu()
    ts = tidal.Timeshare("cuda")
    ts.add_role("a", model=a)
    ts.add_role("b", model=b)
    ts.offload("b")
    with ts.use("a"):
        torch.cuda._sleep(int(2e8))  # the prefetch's copies queue behind this
        assert ts.prefetch("b", write_back=False) is not None
        msg = _expect_tidal_error(lambda: b.weight.sum().item(), "b")
        assert "prefetched" in msg
    with ts.use("b"):
        assert torch.equal(b.weight.detach().cpu(), want)
    ts.close()


def test_a_region_role_is_guarded_and_its_graph_replays_after_the_restore():
    """Weights in a region tag (address-stable backend): while the role is out, a foreign read
    raises tidal's error (its memory is unmapped: a read would fault), the GPU goes on; back in,
    the same addresses, the same bytes, and a CUDA graph captured over them replays exactly."""
    from tidal.vmm import Region

    region = Region("foreign")
    torch.manual_seed(0)
    with region.allocate("w", policy="discard"):
        model = nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024)).cuda()
    x = torch.randn(64, 1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        model(x)  # warm-up before capture, on a side stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        y = model(x)
    graph.replay()
    reference = y.clone()
    ptrs = [p.data_ptr() for p in model.parameters()]
    other = nn.Linear(512, 512).cuda()
    ts = tidal.Timeshare("cuda")
    ts.add_role("rollout", model=model, region=region.tag("w"))
    ts.add_role("train", model=other)
    for cycle in range(3):
        with ts.use("train"):
            assert not region.tags["w"].resident, cycle  # unmapped in place
            for p in model.parameters():
                assert is_out(p)
                _expect_tidal_error(lambda p=p: p.sum().item(), "rollout")
                _expect_tidal_error(lambda p=p: p.data_ptr(), "rollout")
            assert int(torch.ones(1000, device="cuda").sum().item()) == 1000
            other.weight.data.mul_(1.0)
        with ts.use("rollout"):
            assert [p.data_ptr() for p in model.parameters()] == ptrs
            y.zero_()
            graph.replay()  # captured before the role ever went out
            torch.cuda.synchronize()
            assert torch.equal(y, reference), cycle
    ts.close()
