"""Two processes sharing one GPU through the cross-process lease (TCP arbiter; no Ray needed).

Each spawned process (spawn, not fork: CUDA) owns one role, a stack of Linear layers with its
AdamW state, in its own ``tidal.Timeshare("cuda")``, and trains it a few steps per turn for
several turns; ``timeshare_callbacks`` load the role when a turn starts and offload it (memory
back to the driver) when it ends. Checked in the parent:

(a) while one process holds the lease, the driver's used memory, less what the holder's own
    allocator holds, is what it was when no role was resident (within a margin far below one
    role's bytes): the other role's state is not on the GPU;
(b) every role's losses and final parameters are bit-identical to the same steps run in one
    process without any lease or offloading;
(c) no two turns overlap (load start to offload end, ``time.monotonic`` across processes).
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

MIB = 1 << 20
WIDTH, DEPTH = 2048, 10  # 42 M params: ~168 MB of weights, ~670 MB with grads and AdamW state
BATCH = 64
TURNS, STEPS = 3, 4
MARGIN = 256 * MIB
ROLES = ("alpha", "beta")


def _build(role: str) -> torch.nn.Sequential:
    torch.manual_seed(1000 + ROLES.index(role))
    layers = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()]
    return torch.nn.Sequential(*layers[:-1])


def _batch(role: str, turn: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * ROLES.index(role) + 100 * turn + step)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def _train_turn(role: str, model, opt, turn: int) -> list[float]:
    losses = []
    for step in range(STEPS):
        x, y = (t.cuda() for t in _batch(role, turn, step))
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _make(role: str):
    model = _build(role).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def _worker(role: str, address: str, barrier, out_path: str) -> None:
    import tidal
    from tidal.distributed.lease import GPULease, timeshare_callbacks

    torch.cuda.init()
    # Warm up what stays for the process's life (context, cuBLAS handle and workspace, the
    # kernels of the training step at its shapes), then return everything else to the driver.
    warm = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(), torch.nn.Linear(WIDTH, WIDTH)).cuda()
    warm_opt = torch.optim.AdamW(warm.parameters())
    x = torch.randn(BATCH, WIDTH, device="cuda")
    torch.nn.functional.mse_loss(warm(x), x).backward()
    warm_opt.step()
    torch.cuda.synchronize()
    del warm, warm_opt, x
    torch.cuda.empty_cache()
    barrier.wait(120)  # both processes warmed up, neither holds a role: the baseline
    baseline = _used()
    barrier.wait(120)

    ts = tidal.Timeshare("cuda")
    model = opt = None
    callbacks: dict = {}
    spans, checks, losses, params = [], [], [], []
    span: dict = {}

    def acquire_fn() -> None:
        nonlocal model, opt
        span["start"] = time.monotonic()
        span["free_at_grant"] = torch.cuda.mem_get_info()[0]
        if callbacks:
            callbacks["acquire_fn"]()
        else:  # the first turn brings the role into being on the GPU
            model, opt = _make(role)
        torch.cuda.synchronize()

    def release_fn() -> dict:
        if not callbacks:  # registered after the first turn, with its AdamW state
            ts.add_role(role, model=model, optimizer=opt, optimizer_residency="role")
            callbacks.update(timeshare_callbacks(ts, role))
        conf = callbacks["release_fn"]()
        torch.cuda.synchronize()
        span["end"] = time.monotonic()
        return conf

    with GPULease(address, holder=f"{role}:{os.getpid()}") as lease:
        for turn in range(TURNS):
            span = {}
            with lease.hold(role=role, acquire_fn=acquire_fn, release_fn=release_fn) as grant:
                losses.append(_train_turn(role, model, opt, turn))
                torch.cuda.synchronize()
                used = _used()
                checks.append(
                    {"turn": turn, "used": used, "reserved": torch.cuda.memory_reserved(), "previous": grant.previous}
                )
                if turn == TURNS - 1:  # read inside the turn: outside it the role is not resident
                    params = [p.detach().to("cpu", copy=True) for p in model.parameters()]
            spans.append({"role": role, "turn": turn, **span})
    role_bytes = ts.role_bytes(role)
    torch.save({"params": params}, out_path + ".pt")
    with open(out_path, "w") as f:
        json.dump(
            {
                "baseline": baseline,
                "role_bytes": role_bytes,
                "resident_after": ts.is_resident(role),
                "spans": spans,
                "checks": checks,
                "losses": losses,
            },
            f,
        )
    # No ts.close(): it would bring the role back onto the GPU outside a turn. And no exit
    # before the other process is done: its baseline counts this process's CUDA context.
    barrier.wait(120)


def _reference(role: str) -> tuple[list[list[float]], list[torch.Tensor]]:
    model, opt = _make(role)
    losses = [_train_turn(role, model, opt, turn) for turn in range(TURNS)]
    return losses, [p.detach().cpu() for p in model.parameters()]


def _join(procs, *, timeout_s: float) -> None:
    """Wait for every process; once one fails (or time is up), kill the rest rather than
    leave them waiting for a turn or a barrier that never comes."""
    end = time.monotonic() + timeout_s
    while any(p.is_alive() for p in procs) and time.monotonic() < end:
        if any(p.exitcode not in (None, 0) for p in procs):
            break
        time.sleep(0.05)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()


def test_two_processes_take_turns_on_one_gpu(tmp_path):
    from tidal.distributed.lease import LeaseServer

    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(len(ROLES))
    with LeaseServer(ttl_s=30.0) as server:
        procs = {r: ctx.Process(target=_worker, args=(r, server.address, barrier, str(tmp_path / r))) for r in ROLES}
        for p in procs.values():
            p.start()
        _join(list(procs.values()), timeout_s=150)
        for r, p in procs.items():
            assert p.exitcode == 0, f"role {r!r} process exited with {p.exitcode} (its traceback is above)"
        history = server.table.snapshot()["history"]
    got = {r: json.loads((tmp_path / r).read_text()) for r in ROLES}

    # (a) only the holder's state is resident
    for r in ROLES:
        other = next(o for o in ROLES if o != r)
        assert not got[r]["resident_after"]
        assert got[other]["role_bytes"] > 2 * MARGIN, "the roles are too small for the margin to mean anything"
        for c in got[r]["checks"]:
            beyond = c["used"] - c["reserved"] - got[r]["baseline"]
            assert beyond < MARGIN, (
                f"while {r!r} held the lease (turn {c['turn']}), {beyond / MIB:.0f} MiB were used on the GPU "
                f"beyond the baseline and {r!r}'s own allocator: {other!r}'s state "
                f"({got[other]['role_bytes'] / MIB:.0f} MiB) is not released"
            )
            # the measure sees resident state: the holder's own role is counted in it
            assert c["used"] - got[r]["baseline"] > got[r]["role_bytes"] - MARGIN
            prev = c["previous"]
            if prev is not None:
                assert prev["how"] == "released"
                if prev["confirmation"] is not None and prev["role"] != r:
                    assert prev["confirmation"]["bytes_out"] >= got[other]["role_bytes"] - MARGIN

    # (b) bit-identical to one process, no lease, no offloading
    for r in ROLES:
        ref_losses, ref_params = _reference(r)
        assert got[r]["losses"] == ref_losses, r
        params = torch.load(tmp_path / f"{r}.pt")["params"]
        assert len(params) == len(ref_params)
        assert all(torch.equal(a, b) for a, b in zip(params, ref_params)), f"{r}: parameters differ"

    # (c) never two holders at once
    spans = sorted((s for r in ROLES for s in got[r]["spans"]), key=lambda s: s["start"])
    assert len(spans) == len(ROLES) * TURNS
    for a, b in zip(spans, spans[1:]):
        assert a["start"] < a["end"] <= b["start"], (a, b)
    assert sum(1 for e in history if e["event"] == "released") == len(ROLES) * TURNS
    assert not any(e["event"] == "expire" for e in history)
