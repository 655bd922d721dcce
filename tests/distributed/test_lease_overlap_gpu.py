"""Issue 16, item 3, on a GPU: two processes hand one GPU over with both directions overlapped,
where the memory does not hold both roles at once.

The parent fills the GPU so that after both processes' contexts only about 1.5 roles fit. Each
spawned process owns one role (Linear layers with grads and AdamW state, ``"role"`` residency:
every byte moves) and takes turns through the lease with ``timeshare_callbacks(ts, role,
lease=lease)``. A hand-over can then only succeed if the next holder loads into the memory the
previous one gives back chunk by chunk, in step with it: loading ahead of the credit runs out of
memory (the test fails with an OOM), and not loading before the grant shows as no overlap.

Checked: every hand-over with a waiter overlapped (the next load started before the previous
release ended, and ``grant.overlapped``); the holder reported its release in several chunks;
each role's state (weights, grads, AdamW moments) is bit-identical at the start of a turn to
the end of its previous turn (a digest of every byte); no two turns overlap.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GIB = 1 << 30
WIDTH, DEPTH = 8192, 4  # 268 M params: ~4.3 GB with grads and AdamW state
TURNS = 3
ROLES = ("alpha", "beta")
CHUNK = 256 << 20


def _state(model, opt) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        out.append(p)
        if p.grad is not None:
            out.append(p.grad)
    for st in opt.state.values():
        out += [v for v in st.values() if torch.is_tensor(v) and v.numel() > 1]
    return out


def _digest(model, opt) -> list[int]:
    from tidal.state.digest import digest_many

    return digest_many([t.untyped_storage() for t in _state(model, opt)]).tolist()


def _worker(role: str, address: str, barrier, done, out_path: str) -> None:
    import tidal
    from tidal.distributed.lease import GPULease, timeshare_callbacks

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    barrier.wait(120)  # both contexts exist: the parent fills the GPU
    barrier.wait(120)
    ts = tidal.Timeshare("cuda", config=tidal.TimeshareConfig(handover_chunk_bytes=CHUNK))
    model = opt = None
    rows: list[dict] = []
    reports: list[tuple[int, int]] = []
    with GPULease(address, holder=f"{role}:{os.getpid()}") as lease:
        report = lease.report_released
        lease.report_released = lambda r, t: (reports.append((r, t)), report(r, t))[1]
        cb: dict = {}
        for turn in range(TURNS):
            row: dict = {"role": role, "turn": turn}

            def acquire_fn() -> None:
                nonlocal model, opt
                row["load_start"] = time.monotonic()
                if cb:
                    cb["acquire_fn"]()
                else:  # the first turn brings the role into being on the GPU
                    torch.manual_seed(7 + ROLES.index(role))
                    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, device="cuda") for _ in range(DEPTH)])
                    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                    model(torch.randn(4, WIDTH, device="cuda")).square().mean().backward()
                    opt.step()
                torch.cuda.synchronize()
                row["loaded"] = time.monotonic()

            def release_fn() -> dict:
                if not cb:
                    ts.add_role(role, model=model, optimizer=opt, optimizer_residency="role")
                    cb.update(timeshare_callbacks(ts, role, lease=lease))
                row["reports_before"] = len(reports)
                conf = cb["release_fn"]()
                row["reports"] = len(reports) - row["reports_before"]
                row["released"] = time.monotonic()
                return conf

            overlap = bool(cb)
            with lease.hold(role=role, acquire_fn=acquire_fn, release_fn=release_fn, overlap=overlap) as grant:
                row["start"] = time.monotonic()
                row["overlapped"] = grant.overlapped
                row["digest_in"] = _digest(model, opt)
                model(torch.randn(4, WIDTH, device="cuda")).square().mean().backward()
                opt.step()
                row["digest_out"] = _digest(model, opt)
                time.sleep(0.3)  # the other process is queued by now: the hand-over has a waiter
            rows.append(row)
    with open(out_path, "w") as f:
        json.dump({"rows": rows, "role_bytes": ts.role_bytes(role), "reports": reports}, f)
    done.wait(120)  # neither exits (freeing its context) while the other still takes turns


def test_an_overlapped_hand_over_between_processes_fits_where_both_roles_do_not(tmp_path):
    from tests.distributed.test_lease_gpu import _join
    from tidal.distributed.lease import LeaseServer

    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(len(ROLES) + 1)  # the workers and this process, around the filling
    done = ctx.Barrier(len(ROLES))
    role_bytes = DEPTH * (WIDTH * WIDTH + WIDTH) * 4 * 4
    with LeaseServer(ttl_s=60.0) as server:
        procs = {
            r: ctx.Process(target=_worker, args=(r, server.address, barrier, done, str(tmp_path / r))) for r in ROLES
        }
        for p in procs.values():
            p.start()
        filler = None
        try:
            barrier.wait(120)
            free = torch.cuda.mem_get_info()[0]
            # Room for one and a half roles, and a little for activations and staging.
            keep = int(1.5 * role_bytes) + 1 * GIB
            assert free > keep + GIB, f"the GPU has {free / GIB:.1f} GiB free, the test needs {keep / GIB:.1f}"
            filler = torch.empty(free - keep, dtype=torch.uint8, device="cuda")
            barrier.wait(120)
            _join(list(procs.values()), timeout_s=240)
        finally:
            del filler
            torch.cuda.empty_cache()
        for r, p in procs.items():
            assert p.exitcode == 0, f"role {r!r} process exited with {p.exitcode} (its traceback is above)"
    got = {r: json.loads((tmp_path / r).read_text()) for r in ROLES}
    rows = sorted((row for r in ROLES for row in got[r]["rows"]), key=lambda row: row["start"])
    assert len(rows) == len(ROLES) * TURNS
    for prev, nxt in zip(rows, rows[1:]):
        assert prev["released"] <= nxt["start"], "two turns at once"
        if nxt["turn"] == 0:
            continue  # a role coming into being loads nothing
        assert nxt["overlapped"], f"the hand-over to {nxt['role']} turn {nxt['turn']} did not overlap"
        assert nxt["load_start"] < prev["released"], "the next load did not start before the release ended"
        assert prev["reports"] >= 4, f"{prev['role']}'s release was reported in {prev['reports']} chunk(s)"
    for r in ROLES:
        own = got[r]["rows"]
        for a, b in zip(own, own[1:]):
            assert a["digest_out"] == b["digest_in"], f"{r}: state changed between turn {a['turn']} and {b['turn']}"
        assert got[r]["role_bytes"] >= 0.95 * role_bytes
