"""The fault-injection sweep: an exception at every instrumented point of an operation.

A scenario is three functions: ``make()`` builds fresh state and returns it, ``act(state)``
runs the operation, ``check(state, fired)`` verifies what must hold afterwards (``fired`` is
the name of the point where the fault landed, or None for the clean run). The sweep runs
the scenario once with a counting policy to learn its N calls (every stream wait, host wait
and point tidal makes, by name), then once per call k and per exception type with a policy
that raises at call k, and checks each run. It returns N, so each test can report (and
assert a floor on) how many points it covered.

The points are tidal's own (``DeviceOps.point``/``wait_*``, through the sync policy): a fault
lands between two steps of tidal's bookkeeping, where a real ``KeyboardInterrupt`` can land
too, as can a CUDA error surfacing at an event wait.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from tests.policies import CountPoints, FaultAt
from tidal.device import use_sync_policy
from tidal.state.backends import holds_memory
from tests.helpers import is_out

EXCEPTIONS: tuple[type[BaseException], ...] = (KeyboardInterrupt, RuntimeError)
# (operation, points, faults injected) of every sweep run in this session, for the summary
# tests/conftest.py prints at the end.
SWEPT: list[tuple[str, int, int]] = []


def sweep(
    make: Callable[[], Any],
    act: Callable[[Any], None],
    check: Callable[[Any, str | None], None],
    *,
    exceptions: tuple[type[BaseException], ...] = EXCEPTIONS,
) -> list[str]:
    """Run the sweep; returns the names of the points covered (one per call of the clean run)."""
    state = make()
    with use_sync_policy(CountPoints()) as counter:
        act(state)
    check(state, None)
    points = list(counter.calls)
    assert points, "the operation passed no instrumented point: nothing was swept"
    for k, name in enumerate(points):
        for exc in exceptions:
            state = make()
            raised = False
            with use_sync_policy(FaultAt(k, exc)) as fault:
                try:
                    act(state)
                except exc as e:
                    raised = True
                    assert "injected at call" in str(e) or fault.fired, e
            assert fault.fired == name, f"call {k}: expected {name}, fired {fault.fired} (the run is not deterministic)"
            assert raised, f"the {exc.__name__} injected at {name} (call {k}) was swallowed"
            check(state, name)
    SWEPT.append((getattr(act, "__qualname__", repr(act)), len(points), len(points) * len(exceptions)))
    return points


# ---- what every check of a timeshare looks at ------------------------------------------------------
def tensors_of(modules, optimizers) -> list[tuple[str, torch.Tensor]]:
    out = []
    for i, m in enumerate(modules):
        for n, p in m.named_parameters():
            out.append((f"m{i}.{n}", p))
            if p.grad is not None:
                out.append((f"m{i}.{n}.grad", p.grad))
        for n, b in m.named_buffers():
            out.append((f"m{i}.buf.{n}", b))
    for j, o in enumerate(optimizers):
        for k, st in enumerate(o.state.values()):
            for n, v in st.items():
                if isinstance(v, torch.Tensor):
                    out.append((f"o{j}.{k}.{n}", v))
    return out


def assert_consistent(ts, modules, optimizers) -> None:
    """Every tensor of the roles is resident (bytes on the device) or tracked (bytes on the
    host), never neither; no tracked storage still holds device bytes; and each role's flag
    says where its parameters and buffers are."""
    store = ts.store
    for name, t in tensors_of(modules, optimizers):
        if t.numel() == 0:
            continue
        key = t.untyped_storage()._cdata
        if not holds_memory(t.untyped_storage()):  # freed, or a prefetch is still filling it
            assert store.is_offloaded(key), f"{name}: storage freed but not tracked (lost)"
        else:
            assert not store.is_offloaded(key), f"{name}: tracked as offloaded but still holds device bytes"
    small = ts.config.min_offload_bytes  # smaller storages never move
    for role_name in ts.roles:
        role = ts.role(role_name)
        held = [
            t
            for m in role.modules
            for t in list(m.parameters()) + list(m.buffers())
            if t.numel() > 0 and not 0 < t.untyped_storage().nbytes() < small
        ]
        out = [not holds_memory(t.untyped_storage()) for t in held]
        if role.resident:
            assert not any(out), f"role {role_name} is flagged resident but has tensors on the host"
        else:
            assert any(out) or not held, f"role {role_name} is flagged out but all its tensors are on the device"
            assert all(out) or role.in_use, f"role {role_name} is out part-way"


def snapshot(modules, optimizers, store=None) -> dict[str, torch.Tensor]:
    """Host copies of every tensor, read wherever it lives (through the store's host copies for
    offloaded ones), so a check never changes where state is."""
    out = {}
    for name, t in tensors_of(modules, optimizers):
        if t.numel() and is_out(t):
            host = store.host_tensor(t) if store is not None else None
            assert host is not None, f"{name} is empty and not tracked"
            out[name] = host.clone()
        else:
            out[name] = t.detach().to("cpu", copy=True)
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys=None) -> bool:
    keys = a.keys() if keys is None else keys
    return all(k in b and a[k].shape == b[k].shape and torch.equal(_bits(a[k]), _bits(b[k])) for k in keys)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.dtype != torch.bool else t


# ---- a small model with every storage layout (so a sweep has few points but all the kinds) -------
class SmallLM(nn.Module):
    """Tied embedding/head, a parameter that is a view of a buffer, a bf16 parameter, an int
    and a bool buffer; about ten storages (a sweep's cost grows with them)."""

    def __init__(self, vocab: int = 16, hidden: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("flat", torch.randn(2 * hidden))
        self.scale = nn.Parameter(self.flat[hidden:].view(hidden))
        self.gate = nn.Parameter(torch.randn(hidden, dtype=torch.bfloat16))
        self.register_buffer("mask", torch.rand(hidden) > 0.3)
        self.register_buffer("count", torch.arange(3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + self.proj(x) * self.scale * self.gate.float() * self.mask
        return self.head(x)


def small_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def small_trained(seed: int = 0, opt_cls=torch.optim.AdamW):
    """A SmallLM after one step, with grads left in place."""
    torch.manual_seed(seed)
    model = SmallLM()
    opt = opt_cls(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 16, (2, 6))
    small_loss(model, ids).backward()
    opt.step()
    small_loss(model, ids).backward()
    return model, opt
