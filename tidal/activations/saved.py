"""Saved tensors as autograd hands them to the hooks: what to skip, what one storage is, how
a view comes back.

A saved tensor is a *view* (dtype, size, stride, storage offset) of a *storage*. The offloader
moves storages, never views: several saved views of one storage (q, k and v sliced from one
fused projection; a tensor and its transpose) share one :class:`SavedStorage`, copied once,
and each view is rebuilt on unpack from the storage with its own size, stride and offset
(never by shape alone, which would silently read the wrong bytes of a strided view).

What is never offloaded (the hook keeps a detached alias, exactly what autograd would keep):

* parameters, views of parameters and tensors on a parameter's or buffer's storage: their
  memory stays alive for the parameter anyway (FSDP2's unsharded parameters are
  ``nn.Parameter`` too, and FSDP2 frees them itself);
* tensors on another device, non-strided layouts, conjugate / negative-bit views and tensor
  subclasses (DTensor activations of tensor parallelism, fake tensors of ``torch.compile``);
* storages smaller than ``min_offload_bytes``.

The "referenced elsewhere" rule is applied later, when a group is offloaded
(:func:`storage_referenced_elsewhere`); see ``offload.py``.

Memory cost: a :class:`SavedStorage` holds one uint8 alias of the storage while it is on the
device (that alias, not the caller's tensor, is what keeps the bytes alive) and one host slot
while offloaded; a :class:`SavedView` holds only metadata.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from tidal.transfer import HostSlot, byte_view

__all__ = ["SavedStorage", "SavedView", "skip_reason", "storage_referenced_elsewhere", "static_storage_keys"]


def static_storage_keys(model: nn.Module) -> set[int]:
    """Storage identities of the model's parameters and buffers (plain tensors only; DTensor
    shards have no storage of their own here and are caught by the subclass rule)."""
    keys: set[int] = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided and t.device.type != "meta":
            keys.add(t.untyped_storage()._cdata)
    return keys


def skip_reason(t: torch.Tensor, device: torch.device, min_bytes: int, static_keys: set[int]) -> str | None:
    """Why ``t`` must stay where it is, or None if it is a candidate for offload."""
    if isinstance(t, nn.Parameter):
        return "parameter"
    if type(t) is not torch.Tensor:
        return "tensor subclass"
    if t.layout != torch.strided:
        return "non-strided layout"
    if t.device != device:
        return "other device"
    if t.is_conj() or t.is_neg():
        return "conjugate/negative view"
    base = t._base
    if base is not None and isinstance(base, nn.Parameter):
        return "view of a parameter"
    storage = t.untyped_storage()
    if storage.nbytes() < max(min_bytes, 1):
        return "small"
    if storage._cdata in static_keys:
        return "parameter or buffer storage"
    return None


def storage_referenced_elsewhere(alias: torch.Tensor) -> bool:
    """True if anything besides ``alias`` (our one uint8 alias) holds the storage: another
    tensor or view, a parameter, a Python variable of the caller. Offloading such a storage
    would free nothing, so it stays.

    ``_storage_Use_Count`` counts the holders of the StorageImpl: every tensor (view) on it,
    plus the temporary ``UntypedStorage`` wrapper made here to ask.
    """
    storage = alias.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata) > 2


class SavedStorage:
    """One device storage that saved tensors live on, offloaded at most once per step.

    States: on the device (``x_gpu`` set, ``slot`` None); copying out (both set, ``d2h_done``
    pending); offloaded (``x_gpu`` None, ``slot`` set); reloaded (both set, ``h2d_done``).
    """

    __slots__ = (
        "nbytes",
        "x_gpu",
        "slot",
        "group",
        "batch",
        "live_views",
        "h2d_done",
        "waited_streams",
        "alloc_stream",
        "reload_pending_read",
        "unpacked_views",
        "pass_id",
        "disposed",
        "key",
        "__weakref__",
    )

    def __init__(self, storage: torch.UntypedStorage, group: Any) -> None:
        self.nbytes = storage.nbytes()
        self.x_gpu: torch.Tensor | None = byte_view(storage)  # the one alias that keeps it alive
        self.slot: HostSlot | None = None
        self.group = group  # the group it was saved in first
        self.batch: Any = None  # the offload batch (group) that copied it out, if any
        self.live_views = 0
        self.unpacked_views: set[int] = set()  # ids of live views unpacked in this pass
        self.pass_id: int | None = None  # the backward pass unpacked_views refers to
        self.h2d_done: Any = None  # event: reload landed (None on CPU or when not reloaded)
        self.waited_streams: list[Any] = []  # compute streams already ordered after h2d_done
        self.alloc_stream: Any = None  # the stream the reload buffer was allocated on
        self.reload_pending_read = False  # an H2D read of the slot was queued and not consumed
        self.disposed = False
        self.key = storage._cdata  # identity of the storage while this record holds it

    @property
    def offloaded(self) -> bool:
        return self.slot is not None


class SavedView:
    """What a pack hook returns for a candidate: the storage record and the view's metadata."""

    __slots__ = ("storage", "dtype", "size", "stride", "offset", "group_index", "owner")

    def __init__(self, storage: SavedStorage, t: torch.Tensor, group_index: int, owner: Any) -> None:
        self.storage = storage
        self.dtype = t.dtype
        self.size = tuple(t.size())
        self.stride = tuple(t.stride())
        self.offset = t.storage_offset()
        self.group_index = group_index
        self.owner = owner  # the step state; told when the last view of a storage dies
        storage.live_views += 1

    def rebuild(self, x_gpu: torch.Tensor) -> torch.Tensor:
        """The saved view, rebuilt on the storage of ``x_gpu`` (size, stride, offset)."""
        out = torch.empty(0, dtype=self.dtype, device=x_gpu.device)
        return out.set_(x_gpu.untyped_storage(), self.offset, self.size, self.stride)

    def __del__(self) -> None:
        # Autograd drops the packed object when the node that saved it is released (after
        # its backward, or with the graph): the last view of a storage gives its slot back.
        try:
            self.owner.view_died(self.storage, id(self))
        except Exception:  # interpreter shutdown: nothing left to give back to
            pass
