"""CUDA virtual memory management, called through the driver library (no native code to build).

A :class:`VmmDriver` reserves ranges of device virtual addresses, creates physical memory,
maps it into a reserved range and unmaps it again. Unmapping and releasing the physical memory
gives it back to the driver while the addresses stay reserved, so memory mapped there later
appears at the same addresses: every pointer into it (a tensor, a captured CUDA graph, an
inference engine's pool) stays valid across a release and a restore.

:class:`CudaDriver` calls ``libcuda`` through :mod:`ctypes`. :func:`cuda_driver` returns it, or
raises :class:`VmmUnavailableError` saying what is missing (no CUDA build of torch, no driver
library, a device or driver without virtual memory management).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading
from typing import Protocol

import torch

__all__ = ["CudaDriver", "PrimaryContext", "VmmDriver", "VmmUnavailableError", "cuda_driver", "libcuda"]


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


class VmmUnavailableError(RuntimeError):
    """CUDA virtual memory management cannot be used here. The resize backend (the default
    for timeshare roles) needs none of it."""


class VmmDriver(Protocol):
    """The operations a region needs. Addresses and handles are ints; sizes are multiples of
    :attr:`granularity`."""

    granularity: int
    device_index: int

    def reserve(self, nbytes: int) -> int: ...  # a new range of virtual addresses

    def free_range(self, va: int, nbytes: int) -> None: ...  # give a reserved range back

    def create(self, nbytes: int) -> int: ...  # new physical memory; its handle

    def release(self, handle: int) -> None: ...  # give physical memory back (once unmapped)

    def map(self, va: int, nbytes: int, handle: int, offset: int = 0) -> None: ...  # and make it read-write

    def unmap(self, va: int, nbytes: int) -> None: ...

    def view(self, va: int, nbytes: int) -> torch.Tensor: ...  # a uint8 tensor over mapped memory

    def driver_free_bytes(self) -> int: ...


# ---- the CUDA driver ABI (cuda.h), the parts used here -------------------------------------
_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_HANDLE_TYPE_NONE = 0
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
_CU_DEVICE_ATTRIBUTE_VMM_SUPPORTED = 102
_U64 = ctypes.c_uint64  # CUdeviceptr, handles and flags are 64-bit: never pass a bare Python int


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class _CudaArray:
    """``__cuda_array_interface__`` over raw device memory, so torch can view it (no copy, no
    ownership: the region keeps the memory mapped while the view is used)."""

    def __init__(self, va: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (va, False),
            "version": 3,
            "strides": None,
            "stream": None,  # the caller orders its copies with events
        }


class CudaDriver:
    """:class:`VmmDriver` over ``libcuda`` for one device (its primary context, the one torch
    uses). Every call that fails raises ``RuntimeError`` naming the call and the CUDA error."""

    def __init__(self, lib: ctypes.CDLL, device_index: int) -> None:
        self._lib = lib
        self._primary = PrimaryContext(lib, device_index)
        self._check = self._primary.check
        self._current = self._primary.make_current
        self.device_index = device_index
        self.torch_device = torch.device("cuda", device_index)
        dev = ctypes.c_int()
        self._check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), device_index))
        self._cu_device = dev.value
        supported = ctypes.c_int()
        self._check(
            "cuDeviceGetAttribute",
            lib.cuDeviceGetAttribute(ctypes.byref(supported), _CU_DEVICE_ATTRIBUTE_VMM_SUPPORTED, dev),
        )
        if not supported.value:
            raise VmmUnavailableError(
                f"cuda:{device_index} does not support virtual memory management "
                f"(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0); use the resize backend"
            )
        self._primary.retain(dev)
        self._prop = _AllocationProp()
        self._prop.type = _CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.requestedHandleTypes = _CU_MEM_HANDLE_TYPE_NONE
        self._prop.location.type = _CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = self._cu_device
        self._access = _AccessDesc()
        self._access.location.type = _CU_MEM_LOCATION_TYPE_DEVICE
        self._access.location.id = self._cu_device
        self._access.flags = _CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        gran = ctypes.c_size_t()
        self._check(
            "cuMemGetAllocationGranularity",
            lib.cuMemGetAllocationGranularity(
                ctypes.byref(gran), ctypes.byref(self._prop), _CU_MEM_ALLOC_GRANULARITY_MINIMUM
            ),
        )
        self.granularity = int(gran.value)

    # ---- VmmDriver ------------------------------------------------------------------------
    def reserve(self, nbytes: int) -> int:
        self._current()
        va = ctypes.c_uint64()
        self._check(
            "cuMemAddressReserve",
            self._lib.cuMemAddressReserve(
                ctypes.byref(va), ctypes.c_size_t(nbytes), ctypes.c_size_t(0), _U64(0), _U64(0)
            ),
        )
        return int(va.value)

    def free_range(self, va: int, nbytes: int) -> None:
        self._current()
        self._check("cuMemAddressFree", self._lib.cuMemAddressFree(ctypes.c_uint64(va), ctypes.c_size_t(nbytes)))

    def create(self, nbytes: int) -> int:
        self._current()
        handle = ctypes.c_uint64()
        err = self._lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(nbytes), ctypes.byref(self._prop), _U64(0))
        if err == 2:  # CUDA_ERROR_OUT_OF_MEMORY
            raise torch.OutOfMemoryError(
                f"cuMemCreate of {nbytes} bytes on cuda:{self.device_index}: the device is out of memory"
            )
        self._check("cuMemCreate", err)
        return int(handle.value)

    def release(self, handle: int) -> None:
        self._check("cuMemRelease", self._lib.cuMemRelease(ctypes.c_uint64(handle)))

    def map(self, va: int, nbytes: int, handle: int, offset: int = 0) -> None:
        self._current()
        size = ctypes.c_size_t(nbytes)
        self._check(
            f"cuMemMap(va={va:#x}, bytes={nbytes}, offset={offset})",
            self._lib.cuMemMap(ctypes.c_uint64(va), size, ctypes.c_size_t(offset), ctypes.c_uint64(handle), _U64(0)),
        )
        err = self._lib.cuMemSetAccess(ctypes.c_uint64(va), size, ctypes.byref(self._access), 1)
        if err != 0:
            self._lib.cuMemUnmap(ctypes.c_uint64(va), size)  # leave nothing half made
            self._check("cuMemSetAccess", err)

    def unmap(self, va: int, nbytes: int) -> None:
        self._current()
        self._check("cuMemUnmap", self._lib.cuMemUnmap(ctypes.c_uint64(va), ctypes.c_size_t(nbytes)))

    def view(self, va: int, nbytes: int) -> torch.Tensor:
        return torch.as_tensor(_CudaArray(va, nbytes), device=self.torch_device)

    def driver_free_bytes(self) -> int:
        return int(torch.cuda.mem_get_info(self.device_index)[0])


def _libcuda() -> ctypes.CDLL:
    lib = libcuda()
    if lib is not None:
        return lib
    raise VmmUnavailableError(
        "the CUDA driver library (libcuda.so.1) could not be loaded; address-stable regions need an NVIDIA "
        "driver. The resize backend works without it"
    )


_DRIVERS: dict[int, CudaDriver] = {}
_DRIVERS_LOCK = threading.Lock()


def cuda_driver(device: int | str | torch.device | None = None) -> CudaDriver:
    """The :class:`CudaDriver` of a CUDA device (the current one by default), made once per
    device. Raises :class:`VmmUnavailableError` when torch has no CUDA device or the driver
    lacks virtual memory management."""
    if not torch.cuda.is_available():
        raise VmmUnavailableError(
            "address-stable regions need a CUDA device and a CUDA build of torch "
            f"(torch {torch.__version__} reports none); the resize backend works without one"
        )
    if device is None:
        index = torch.cuda.current_device()
    elif isinstance(device, int):
        index = device
    else:
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"address-stable regions are for CUDA devices, got {str(dev)!r}")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
    with _DRIVERS_LOCK:
        drv = _DRIVERS.get(index)
        if drv is None:
            torch.cuda.init()  # the primary context torch uses is the one regions map into
            lib = _libcuda()
            if lib.cuInit(0) != 0:
                raise VmmUnavailableError("cuInit failed: the CUDA driver cannot be initialised here")
            drv = _DRIVERS[index] = CudaDriver(lib, index)
        return drv
