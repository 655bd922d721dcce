"""optimizer_residency="stream": the optimizer's update runs a chunk of parameters at a time
with only that chunk's state on the device, and computes exactly what one step() would."""

import time

import pytest
import torch

import tidal
from tests.helpers import TinyLM, assert_same_state, held_bytes, is_out, lm_loss, snapshot_state


def _opt(model, kind):
    groups = [
        {"params": [p for n, p in model.named_parameters() if "norm" not in n], "weight_decay": 0.1},
        {"params": [p for n, p in model.named_parameters() if "norm" in n], "weight_decay": 0.0},
    ]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=1e-2, momentum=0.9)
    return torch.optim.AdamW(groups, lr=1e-2, **({"fused": True} if kind == "adamw-fused" else {}))


def _train(kind, residency, steps=5, chunk_bytes=2048):
    torch.manual_seed(0)
    model = TinyLM(dropout=0.0)
    opt = _opt(model, kind)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ts = None
    if residency is not None:
        ts = tidal.Timeshare("cpu", config=tidal.TimeshareConfig(optimizer_chunk_bytes=chunk_bytes))
        ts.add_role("actor", model=model, optimizer=opt, optimizer_residency=residency)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 64, (4, 9), generator=gen)
        lm_loss(model, ids).backward()
        opt.step()
        sched.step()
        if ts is not None:
            # between steps every optimizer state tensor is on the host (storage size 0)
            assert all(
                is_out(v)
                for st in opt.state.values()
                for k, v in st.items()
                if isinstance(v, torch.Tensor) and v.numel() > 4
            ), residency
            ts.load("actor")  # resident, optimizer state still on the host
        snap = snapshot_state(model)  # grads of this step still in place after step()
        opt.zero_grad()
    if ts is not None:
        ts.close()
    return snap, snapshot_state(model, opt)


@pytest.mark.parametrize("kind", ["adamw", "adamw-fused", "sgd"])
def test_streamed_step_is_bit_exact(kind):
    want_grads, want = _train(kind, None)
    got_grads, got = _train(kind, "stream")
    assert_same_state(got_grads, want_grads)  # the grads hidden during the chunks came back
    assert_same_state(got, want)


def test_streamed_step_holds_one_chunk_of_state_at_a_time():
    torch.manual_seed(0)
    model = TinyLM(dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    chunk = 4096
    ts = tidal.Timeshare("cpu", config=tidal.TimeshareConfig(optimizer_chunk_bytes=chunk))
    ts.add_role("actor", model=model, optimizer=opt, optimizer_residency="stream")
    on_device = []

    def spy(o, args, kwargs):  # runs before every per-chunk step() too
        on_device.append(
            sum(
                held_bytes(v)
                for st in o.state.values()
                for v in st.values()
                if isinstance(v, torch.Tensor) and v.numel() > 1
            )
        )

    opt.register_step_pre_hook(spy)
    ids = torch.randint(0, 64, (4, 9))
    largest = max(2 * p.numel() * p.element_size() for p in model.parameters())
    total = sum(2 * p.numel() * p.element_size() for p in model.parameters())
    for _ in range(3):
        lm_loss(model, ids).backward()
        opt.step()
        opt.zero_grad()
    assert len(on_device) > 6  # several chunks per step, not one call
    assert max(on_device) <= chunk + largest < total
    assert max(on_device) > 0  # the state really was on the device for its chunk
    kinds = {r.kind for r in ts.records}
    assert "optim-stream" in kinds and "optim-in" in kinds
    ts.close()


def _stream_actor(seed=0):
    torch.manual_seed(seed)
    model = TinyLM(dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ts = tidal.Timeshare("cpu", config=tidal.TimeshareConfig(optimizer_chunk_bytes=4096))
    ts.add_role("actor", model=model, optimizer=opt, optimizer_residency="stream")
    return model, opt, ts


def test_error_inside_a_streamed_step_consumes_only_the_chunks_stepped_and_step_again_completes_it():
    ids = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(3))
    runs = []
    for fail in (False, True):
        model, opt, ts = _stream_actor()
        with ts.use("actor"):
            lm_loss(model, ids).backward()
            opt.step()
            opt.zero_grad()
        calls = []

        def boom(o, args, kwargs):
            calls.append(1)
            if fail and len(calls) == 3:  # the outer step, then chunks 0 and 1 stepped, chunk 2 refused
                raise RuntimeError("boom")

        h = opt.register_step_pre_hook(boom)
        with ts.use("actor"):
            lm_loss(model, ids).backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            if fail:
                with pytest.raises(RuntimeError, match="boom"):
                    opt.step()
                kept = {n for n, p in model.named_parameters() if p.grad is not None}
                # Chunks 0 and 1 consumed their grads; every other grad is back, unchanged.
                assert 0 < len(kept) < len(grads)
                for n in kept:
                    assert torch.equal(dict(model.named_parameters())[n].grad, grads[n]), n
                h.remove()
            opt.step()  # completes the interrupted step
        h.remove()
        # the use() block's end put the optimizer state back on the host
        assert all(
            is_out(v)
            for st in opt.state.values()
            for k, v in st.items()
            if isinstance(v, torch.Tensor) and v.numel() > 4
        )
        ts.close()
        runs.append(snapshot_state(model, opt))
    # snapshot_state includes grads: drop them (the interrupted run consumed some)
    want, got = ({k: v for k, v in r.items() if not k.endswith(".grad")} for r in runs)
    assert_same_state(got, want)


def test_streamed_step_leaves_gradients_and_param_groups_as_they_were():
    """The streamed step narrows the param groups for each chunk instead of hiding .grad:
    after step() every gradient is the one backward produced, and the groups hold the same
    parameter objects as before, also when a later step pre-hook raised."""
    model, opt, ts = _stream_actor()
    ids = torch.randint(0, 64, (4, 9))
    groups = [list(g["params"]) for g in opt.param_groups]
    with ts.use("actor"):
        lm_loss(model, ids).backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        opt.step()
        assert all(p.grad is grads[n] for n, p in model.named_parameters()), "gradients untouched"
        assert [list(g["params"]) for g in opt.param_groups] == groups

        def late(o, a, k):
            raise RuntimeError("a later hook")

        h = opt.register_step_pre_hook(late)
        with pytest.raises(RuntimeError, match="a later hook"):
            opt.step()  # tidal's pre-hook streamed the update, then this one raised
        h.remove()
    assert [list(g["params"]) for g in opt.param_groups] == groups, "the end of use() put the groups back"
    ts.close()


def test_a_streamed_steps_records_leave_the_chunks_updates_out_of_their_host_time():
    """Each optim-stream record's host time runs from the end of its chunk's update: the
    optimizer's own work is not counted as the transition's."""
    model, opt, ts = _stream_actor()
    ids = torch.randint(0, 64, (4, 9))
    lm_loss(model, ids).backward()
    opt.step()  # creates the state; the next step streams it
    opt.zero_grad()
    lm_loss(model, ids).backward()
    updates = []

    def slow(o, args, kwargs):  # runs before every chunk's step() too: a 20 ms update
        updates.append(1)
        time.sleep(0.02)

    opt.register_step_pre_hook(slow)
    first = len(ts.records)
    opt.step()
    chunks = [r for r in ts.records[first:] if r.kind == "optim-stream"]
    assert len(chunks) >= 4 and len(updates) > len(chunks)
    assert all(r.host_seconds < 0.015 for r in chunks), [r.host_seconds for r in chunks]
    ts.close()
