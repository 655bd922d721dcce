"""Many copies queued by one driver call: ``cuMemcpyBatchAsync`` (CUDA 12.8 and later).

Queueing a copy through torch costs the host tens of microseconds (a byte view of the storage,
the dispatcher, ``cudaMemcpyAsync``); a role of a few hundred storages then costs the host
about as long to queue as its copies take on the link. That does not matter for a switch, which
waits for its copies anyway, but it is the whole cost of a copy queued behind compute (a
prefetch, a write-back): the phase waits for the host. One batched call takes the addresses of
every copy at once, so queueing a role costs the host what building three arrays costs.

:func:`batch_copier` returns a :class:`BatchCopier` for a CUDA device whose driver offers the
call, or None (CPU, another accelerator, an older driver); callers then queue one copy per
storage through torch, which is correct everywhere and slower to queue.

Nothing here touches CUDA at import time.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading
from typing import Sequence

import torch

__all__ = ["BatchCopier", "PrimaryContext", "batch_copier", "libcuda"]

# cuda.h: CUmemcpySrcAccessOrder, CUmemLocationType, CUmemcpyFlags
_SRC_ACCESS_ORDER_STREAM = 1  # the source is read in stream order (it may change until then)
_LOCATION_DEVICE = 1
_LOCATION_HOST = 2
_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1  # copy engines, not SMs: the copies run beside compute


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _Location),
        ("dstLocHint", _Location),
        ("flags", ctypes.c_uint),
    ]


@functools.lru_cache(maxsize=None)
def libcuda() -> ctypes.CDLL | None:
    """The CUDA driver library, or None where there is none."""
    for name in ("libcuda.so.1", ctypes.util.find_library("cuda")):
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


class PrimaryContext:
    """Calls into the driver library on one device's primary context (the one torch uses).

    Args:
        lib: the driver library.
        device_index: the device.
    """

    def __init__(self, lib: ctypes.CDLL, device_index: int) -> None:
        self.lib = lib
        self.device_index = device_index
        self._local = threading.local()
        self._context: ctypes.c_void_p | None = None

    def retain(self, cu_device: int) -> None:
        """Take a reference on the device's primary context (``cu_device``: its ``CUdevice``)."""
        ctx = ctypes.c_void_p()
        self.check("cuDevicePrimaryCtxRetain", self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), cu_device))
        self._context = ctx

    def make_current(self) -> None:
        """Driver calls act on the calling thread's current context: make the primary context
        current on a thread that may never have touched CUDA (autograd's), once per thread."""
        if getattr(self._local, "ready", False):
            return
        assert self._context is not None, "retain() first"
        ctx = ctypes.c_void_p()
        self.check("cuCtxGetCurrent", self.lib.cuCtxGetCurrent(ctypes.byref(ctx)))
        if ctx.value != self._context.value:
            self.check("cuCtxSetCurrent", self.lib.cuCtxSetCurrent(self._context))
        self._local.ready = True

    def check(self, call: str, err: int) -> None:
        """Raise ``RuntimeError`` naming ``call`` and the driver's error unless ``err`` is 0."""
        if err == 0:
            return
        name = ctypes.c_char_p()
        self.lib.cuGetErrorName(err, ctypes.byref(name))
        raise RuntimeError(
            f"{call} failed on cuda:{self.device_index} with "
            f"{name.value.decode() if name.value else 'CUDA error'} ({err})"
        )


class BatchCopier:
    """Queues copies between device memory and pinned host memory of one CUDA device, many per
    driver call, on a given stream. The caller orders them with events as for any copy on that
    stream; the copies of one call run in no particular order among themselves.

    Args:
        lib: the driver library.
        fn: its ``cuMemcpyBatchAsync``; ``with_fail_index``: the CUDA 12.8 signature (a
            ``failIdx`` out-parameter before the stream), else the CUDA 13 one.
        device_index: the device (its primary context is the one torch uses).
    """

    def __init__(self, lib: ctypes.CDLL, fn, *, with_fail_index: bool, device_index: int) -> None:
        self._fn = fn
        self._with_fail_index = with_fail_index
        self.device_index = device_index
        self._attrs: dict[bool, _MemcpyAttributes] = {}
        for to_device in (True, False):
            a = _MemcpyAttributes()
            a.srcAccessOrder = _SRC_ACCESS_ORDER_STREAM
            host = _Location(_LOCATION_HOST, 0)
            dev = _Location(_LOCATION_DEVICE, device_index)
            a.srcLocHint, a.dstLocHint = (host, dev) if to_device else (dev, host)
            a.flags = _FLAG_PREFER_OVERLAP_WITH_COMPUTE
            self._attrs[to_device] = a
        self._zero = ctypes.c_size_t(0)
        self._ctx = PrimaryContext(lib, device_index)
        dev = ctypes.c_int()
        self._ctx.check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), device_index))
        self._ctx.retain(dev)

    def copy(
        self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int], stream: int, *, to_device: bool
    ) -> None:
        """Queue ``sizes[i]`` bytes from ``srcs[i]`` to ``dsts[i]`` for every ``i`` on ``stream``
        (a ``CUstream`` handle, e.g. ``torch.cuda.Stream.cuda_stream``), host to device when
        ``to_device``. Raises ``RuntimeError`` naming the driver's error (nothing queued)."""
        n = len(sizes)
        if n == 0:
            return
        self._ctx.make_current()
        u64 = ctypes.c_uint64 * n
        args = [
            u64(*dsts),
            u64(*srcs),
            (ctypes.c_size_t * n)(*sizes),
            ctypes.c_size_t(n),
            ctypes.byref(self._attrs[to_device]),
            ctypes.byref(self._zero),  # attrsIdxs: the one attribute applies from copy 0 on
            ctypes.c_size_t(1),
        ]
        if self._with_fail_index:
            args.append(ctypes.byref(ctypes.c_size_t(0)))
        args.append(ctypes.c_void_p(stream))
        self._ctx.check("cuMemcpyBatchAsync", self._fn(*args))


_COPIERS: dict[int, BatchCopier | None] = {}
_LOCK = threading.Lock()


def batch_copier(device: torch.device) -> BatchCopier | None:
    """The :class:`BatchCopier` of a CUDA device, or None where the driver has no batched copy
    (or the device is not CUDA). Made once per device."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _LOCK:
        if index not in _COPIERS:
            _COPIERS[index] = _make(index)
        return _COPIERS[index]


def _make(index: int) -> BatchCopier | None:
    lib = libcuda()
    if lib is None:
        return None
    torch.cuda.init()  # torch's primary context exists before the driver is asked for it
    version = ctypes.c_int()
    if lib.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value < 12080:
        return None
    # CUDA 13 renamed the 12.8 signature's successor (no failIdx) cuMemcpyBatchAsync_v2 in the
    # library; the plain name keeps the 12.8 signature.
    for name, with_fail_index in (("cuMemcpyBatchAsync_v2", False), ("cuMemcpyBatchAsync", True)):
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype = ctypes.c_int
            return BatchCopier(lib, fn, with_fail_index=with_fail_index, device_index=index)
    return None
