"""Issue 27: host memory running out in the middle of an offload (a storage that needs a new
host slot, here a gradient that appeared after the role was registered) raises tidal's error
naming the role, the bytes asked for and the bytes available, not torch's raw allocator
message; and the state stays intact. In a child process under an address-space limit
(``RLIMIT_AS``), the way a container or ``ulimit -v`` limits a trainer."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

resource = pytest.importorskip("resource")

_CHILD = textwrap.dedent(
    """
    import resource, torch, tidal
    from tidal.errors import HostMemoryError

    def vm_bytes():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))

    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 2048, bias=False)  # 16 MiB of weights
    ts = tidal.Timeshare("cpu")
    ts.add_role("actor", model=model)  # host slots for the weights, not yet for any gradient
    ts.add_role("other", model=torch.nn.Linear(8, 8))
    model(torch.randn(4, 2048)).sum().backward()  # a 16 MiB gradient, no host slot yet
    weight, grad = model.weight.detach().clone(), model.weight.grad.clone()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + (4 << 20), hard))  # 4 MiB of headroom
    try:
        ts.offload("actor")
    except HostMemoryError as e:
        print("RAISED", e)
    else:
        print("NO ERROR")
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert ts.is_resident("actor")
    assert torch.equal(model.weight, weight) and torch.equal(model.weight.grad, grad), "state changed"
    ts.offload("actor")  # with the memory back, the same offload goes through
    ts.load("actor")
    assert torch.equal(model.weight, weight) and torch.equal(model.weight.grad, grad)
    ts.close()
    print("INTACT")
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmSize from /proc")
def test_host_memory_running_out_mid_offload_names_the_role_and_the_bytes():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "RAISED role 'actor' needs 16.00 MiB (16777216 bytes) of host memory" in out, out
    available = int(out.split("bytes) available")[0].rsplit("(", 1)[1])
    assert available < 16 << 20, out  # the address-space limit's headroom, not the machine's free RAM
    assert "Nothing was moved and the state is intact" in out, out
    assert "INTACT" in out
