"""The streamed optimizer step: optimizer state brought in and sent out a chunk of
parameters at a time, so ``step()`` never holds all of it on the device.

With ``optimizer_residency="stream"`` the timeshare's step pre-hook runs the whole update
here: the parameters with gradients are split into chunks of about
``TimeshareConfig.optimizer_chunk_bytes`` of state; for each chunk its state is reloaded, the
optimizer's own ``step()`` runs with only that chunk's parameters in its param groups (the
groups' lists are narrowed for the call and restored; gradients are never touched), and the
next chunk's state comes in while this one's goes out, both copy engines busy. The outer
``step()`` then finds its param groups empty and does nothing; its post-hook restores them.
Hyper-parameters (``lr``, betas, a scheduler's changes) stay in the groups throughout.
Per-parameter optimizers (Adam, AdamW, SGD, ...) compute exactly what one
call would: their update of a parameter reads only that parameter's state. Optimizers whose
update couples parameters (LBFGS, a global-norm clip inside ``step()``) must not use it.

Peak device memory of the step: params + grads + one chunk's state (two while the copies of
neighbouring chunks overlap; up to four with ``TimeshareConfig(wait_for_copies=False)``, where
the copies out of two chunks may still run while the next two are stepped), plus the
transfers' staging (at most one bucket out and two in, ``TransferConfig.bucket_bytes`` each),
instead of params + grads + all of it. Chunks a :meth:`~tidal.Timeshare.prefetch_optimizer` brought in ahead
are not copied again; with an optimizer that updates in place (``fused=True``), consecutive
chunks that arrived ahead are stepped and sent out as one, and the chunks after them are
brought in only once that one's copy out leaves at most two chunks' bytes in flight.
"""

from __future__ import annotations

import torch

from tidal.state.collect import StateEntry, collect_optimizer_state
from tidal.state.moves import SwitchOptions
from tidal.timeshare.core import TimeshareCore
from tidal.timeshare.role import Role

__all__ = ["streamed_step"]

# Chunks whose state may be on its way out while the next comes in (wait_for_copies=False):
# two keep both copy engines busy; the device then holds at most four chunks of state.
_IN_FLIGHT = 2


def _state_bytes(opt: torch.optim.Optimizer, p: torch.Tensor) -> int:
    st = opt.state.get(p, {})
    held = sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
    # Before the first step there is no state yet; Adam's two moments are the usual size.
    return max(held, 2 * p.numel() * p.element_size())


def _chunks(opt: torch.optim.Optimizer, params: list[torch.Tensor], chunk_bytes: int) -> list[list[torch.Tensor]]:
    out, cur, cur_bytes = [], [], 0
    for p in params:
        cur.append(p)
        cur_bytes += _state_bytes(opt, p)
        if cur_bytes >= chunk_bytes:
            out.append(cur)
            cur, cur_bytes = [], 0
    if cur:
        out.append(cur)
    return out


def _entries(ts: TimeshareCore, role: Role, opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[StateEntry]:
    # The state of these parameters only; include_empty: offloaded storages have size 0 and
    # must still be found.
    return collect_optimizer_state(
        [opt],
        ts.device,
        names=role.param_names(),
        min_offload_bytes=ts.config.min_offload_bytes,
        include_empty=True,
        params=params,
        owner=role.name,
    )


def _narrow(opt: torch.optim.Optimizer, keep: set) -> list[list[torch.Tensor]]:
    """Leave in each param group only the parameters in ``keep`` (in their order); returns the
    groups' own lists, for :func:`restore_groups`."""
    saved = [g["params"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["params"] = [p for p in g["params"] if p in keep]
    return saved


def restore_groups(opt: torch.optim.Optimizer, saved: list[list[torch.Tensor]]) -> None:
    for g, params in zip(opt.param_groups, saved):
        g["params"] = params


def _in_place(opt: torch.optim.Optimizer) -> bool:
    """The optimizer updates its state in place with no temporaries the size of a chunk (every
    group ``fused``): stepping more parameters in one call costs no more memory."""
    return all(g.get("fused") for g in opt.param_groups)


def _merge_arrived(
    ts: TimeshareCore, role: Role, opt: torch.optim.Optimizer, chunks: list[list[torch.Tensor]]
) -> list[list[torch.Tensor]]:
    """Consecutive chunks whose state ``prefetch_optimizer`` has brought in ahead, as one chunk:
    their memory is held anyway, and one ``step()`` and one switch out cost the host one call
    each instead of one per chunk."""
    out: list[list[torch.Tensor]] = []
    merging = False
    for chunk in chunks:
        entries = ts.store.resolve(_entries(ts, role, opt, chunk))
        # Only state a prefetch brought in, for every parameter of the chunk: a parameter with
        # no state yet gets it in step(), and creating it for many chunks at once is the memory
        # streaming exists to bound.
        here = (
            bool(entries) and all(opt.state.get(p) for p in chunk) and all(ts.store.is_arriving(e.key) for e in entries)
        )
        if here and merging:
            out[-1] = out[-1] + chunk
        else:
            out.append(list(chunk))
        merging = here
    return out


def streamed_step(ts: TimeshareCore, role: Role, opt: torch.optim.Optimizer) -> None:
    """Run ``opt``'s update chunk by chunk (see the module docstring). Each chunk's ``step()``
    sees only that chunk's parameters in the param groups; the gradients are never touched.
    Leaves every state tensor of ``opt`` on the host and the param groups empty, saved with
    the role (:meth:`Role.end_stream`) for the step post-hook to restore (so the outer
    ``step()`` updates nothing a second time). On an exception the groups come back at once and the chunks
    already stepped have consumed their gradients (set to None), so ``step()`` again
    completes exactly this step."""
    params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
    stepped: list[torch.Tensor] = []
    # (D2H event, bytes) of the chunks copied out without a host wait, oldest first
    departing: list[tuple[object, int]] = []
    in_flight_bytes = _IN_FLIGHT * ts.config.optimizer_chunk_bytes
    others = ts.resident_keys(exclude=(role,))
    role.begin_stream()
    saved = [g["params"] for g in opt.param_groups]
    ok = False
    try:
        chunks = _chunks(opt, params, ts.config.optimizer_chunk_bytes)
        if _in_place(opt):
            chunks = _merge_arrived(ts, role, opt, chunks)
        incoming = (
            [e for e in ts.store.resolve(_entries(ts, role, opt, chunks[0])) if ts.store.is_offloaded(e.key)]
            if chunks
            else []
        )
        if incoming:
            ts.record_move(
                "optim-in",
                (),
                role.name,
                ts.store.reload(incoming, what=f"optimizer state of {role.name!r}", wait=ts.config.wait_for_copies),
                note="optimizer state chunk",
            )
        for i, chunk in enumerate(chunks):
            _narrow(opt, set(chunk))
            try:
                opt.step()  # this chunk only: the hooks see role.streaming and stand aside
            finally:
                restore_groups(opt, saved)
            ts._start_clock()  # the chunk's update is the step's own work, not its transition
            stepped.extend(chunk)
            out = [e for e in _entries(ts, role, opt, chunk) if e.nbytes > 0 and e.key not in others]
            nxt = (
                [e for e in ts.store.resolve(_entries(ts, role, opt, chunks[i + 1])) if ts.store.is_offloaded(e.key)]
                if i + 1 < len(chunks)
                else []
            )
            last = i + 1 == len(chunks)
            needs_memory = any(not ts.store.is_arriving(e.key) for e in nxt)
            while (
                needs_memory
                and departing
                and (len(departing) >= _IN_FLIGHT or sum(n for _, n in departing) > in_flight_bytes)
            ):
                # Copies out go on without the host (wait_for_copies=False); the next chunk needs
                # new memory: bound what is on the device to the chunks in flight (by count, and
                # by bytes for a merged chunk), the oldest's memory coming free once its copy
                # out has run.
                ts.store.engine.wait("stream_chunk_departed", departing.pop(0)[0])
            # Blocks freed here are what the next chunk reuses: return them to the driver
            # only once, after the last chunk.
            how = SwitchOptions(
                what=f"optimizer state of {role.name!r}",
                release=None if last else False,
                wait=ts.config.wait_for_copies,
            )
            move = ts.store.switch(out, nxt, how)
            ts.record_move("optim-stream", (role.name,), role.name if nxt else None, move, note="optimizer state chunk")
            if move.queued and ts.store.departure_event is not None:
                departing.append((ts.store.departure_event, move.bytes_out))
                del departing[:-_IN_FLIGHT]
        ok = True
    finally:
        role.end_stream((opt, _narrow(opt, set())) if ok else None)  # ok: the outer step() finds nothing
        if not ok:
            # The chunks already stepped consumed their gradients; the others keep theirs, so
            # calling step() again completes exactly this step (optimizers skip parameters
            # without a gradient).
            for p in stepped:
                p.grad = None
