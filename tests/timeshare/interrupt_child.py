"""Child process of test_interrupt_gpu.py: moves a large role in a loop until a real signal
(SIGINT, or SIGTERM turned into SystemExit by a handler, as schedulers do) lands somewhere in
a transition, then checks that nothing was lost and prints what it found.

    python -m tests.timeshare.interrupt_child offload|switch [sigterm]
"""

from __future__ import annotations

import signal
import sys
import traceback

import torch
import torch.nn as nn

import tidal
from tidal.state.digest import digest
from tests.helpers import is_out

MiB = 1 << 20


def _digests(params) -> list[int]:
    return [int(digest(p.detach().view(-1).view(torch.uint8))) for p in params]


def main() -> int:
    mode = sys.argv[1]
    if "sigterm" in sys.argv[2:]:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
    torch.manual_seed(0)
    # 16 x 512 MiB = 8 GiB moving per transition (~0.15 s each way at the line rate), plus
    # small storages that go through the staging buckets.
    a = nn.ParameterList(
        [nn.Parameter(torch.randn(512 * MiB // 4, device="cuda")) for _ in range(16)]
        + [nn.Parameter(torch.randn(1000 + i, device="cuda")) for i in range(64)]
    )
    b = nn.ParameterList([nn.Parameter(torch.randn(256 * MiB // 4, device="cuda")) for _ in range(16)])
    want = {"a": _digests(a), "b": _digests(b)}
    ts = tidal.Timeshare("cuda")
    ts.add_role("a", model=a)
    ts.add_role("b", model=b)
    if mode == "switch":
        ts.load("a")
    print("READY", flush=True)
    cycles = 0
    try:
        while True:
            if mode == "offload":
                ts.offload("a")
                ts.load("a")
            else:
                ts.load("b")
                ts.load("a")
            cycles += 1
    except (KeyboardInterrupt, SystemExit) as e:
        where = [f.name for f in traceback.extract_tb(e.__traceback__) if "/tidal/" in f.filename]
        print(f"INTERRUPTED {type(e).__name__} after {cycles} cycles in {' > '.join(where) or 'user code'}", flush=True)
    # Every storage is resident or tracked; each role's flag says where its tensors are.
    for name, module in (("a", a), ("b", b)):
        out = [is_out(p) for p in module.parameters()]
        for p, gone in zip(module.parameters(), out):
            assert not gone or ts.store.is_offloaded(p.untyped_storage()._cdata), f"{name}: a freed storage is lost"
        if ts.is_resident(name):
            assert not any(out), f"role {name} flagged resident with tensors on the host"
        else:
            assert all(o for p, o in zip(module.parameters(), out) if p.numel() * 4 >= 16), f"role {name} out part-way"
    for name, module in (("a", a), ("b", b)):
        ts.load(name)  # the next transition works
        got = _digests(module)
        assert got == want[name], f"role {name}: {sum(x != y for x, y in zip(got, want[name]))} tensors changed"
    ts.close()
    torch.cuda.synchronize()
    print("CONSISTENT", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
