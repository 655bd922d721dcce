"""Wrapper subclasses whose flattening lists non-tensor attributes (torch >= 2.13's DTensor
lists its device mesh) are opened down to their tensors, the rest skipped."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from tidal.state.collect import collect_module_state, collect_optimizer_state


class _Meshy:
    """Stands in for a DeviceMesh: an opaque object named by ``__tensor_flatten__``."""


class MeshTensor(torch.Tensor):
    """A wrapper subclass flattening to ``["_local", "mesh"]``, as DTensor does."""

    @staticmethod
    def __new__(cls, local: torch.Tensor, mesh: _Meshy):
        return torch.Tensor._make_wrapper_subclass(
            cls, local.shape, dtype=local.dtype, device=local.device, requires_grad=local.requires_grad
        )

    def __init__(self, local: torch.Tensor, mesh: _Meshy) -> None:
        self._local = local
        self.mesh = mesh

    def __tensor_flatten__(self):
        return ["_local", "mesh"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return MeshTensor(inner["_local"], inner["mesh"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x._local if isinstance(x, MeshTensor) else x  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def test_wrapper_with_non_tensor_attribute_yields_its_local_storage():
    local = torch.randn(6, 4)
    module = torch.nn.Module()
    module.register_buffer("weight", MeshTensor(local, _Meshy()))
    entries = collect_module_state([module], torch.device("cpu"))
    assert [e.name for e in entries] == ["weight._local"]
    assert entries[0].storage._cdata == local.untyped_storage()._cdata
    assert entries[0].nbytes == 6 * 4 * 4


def test_optimizer_state_wrappers_are_opened_too():
    p = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.SGD([p], lr=0.1)
    moment = torch.randn(5)
    opt.state[p] = {"exp_avg": MeshTensor(moment, _Meshy())}
    entries = collect_optimizer_state([opt], torch.device("cpu"))
    assert [e.storage._cdata for e in entries] == [moment.untyped_storage()._cdata]
