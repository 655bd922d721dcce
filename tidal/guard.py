"""Storage guards: a storage whose bytes tidal moved out refuses every access to them, with a
message that names the role and the fix.

Why this works at no cost per op: every read or write of a tensor's bytes in torch goes
through two accessors of its ``c10::StorageImpl`` (``data()`` and ``mutable_data()``, under
``data_ptr()``, ``const_data_ptr()``, ``mutable_data_ptr()``), and both already test a flag of
the storage, ``throw_on_immutable_data_ptr_``, before returning the pointer; when it is set they
raise ``RuntimeError`` with the storage's own message (torch's CUDA graph trees use it for the
outputs of a graph that ran again). Kernels (CPU and CUDA, cuBLAS, Triton through
``data_ptr()``), ``numpy()``, ``tolist()``, ``torch.save`` and collectives all take the
pointer through those accessors on the host, before anything is launched, so a guarded
storage raises where a read of freed memory would have crashed (a segfault, or an illegal
address that poisons the CUDA context). Nothing runs per op: the branch is in torch already,
taken for every tensor, guarded or not.

What torch does not offer from Python is clearing the flag (CUDA builds can only set it, CPU
builds neither), nor freeing a storage's memory while keeping its size. So tidal builds a small
C++ library on first use (the ``c10`` headers that ship with torch, the host's C++ compiler,
about 5 s once, cached per torch build under ``$TIDAL_CACHE_DIR`` or ``~/.cache/tidal``) and
calls it through :mod:`ctypes`; a self-test checks it before it is used.

A storage released here keeps its size (``nbytes()``) and loses its memory, so views, slices
and ``print`` of its tensors reach the data accessors, which raise tidal's message, instead of
failing torch's bounds check with a message about storage sizes. :func:`unseal` gives it size
0 again (``resize_`` then allocates it as usual).

Where the library cannot be built (no compiler, ``TIDAL_STORAGE_GUARD=off``), :func:`release`
falls back to ``resize_(0)`` and guards nothing: reads of moved-out tensors are then undefined,
as before; :func:`status` says why, and constructing a timeshare warns once.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
import weakref

import torch

__all__ = [
    "address",
    "available",
    "flag_set",
    "is_freed",
    "is_sealed",
    "release",
    "seal",
    "sealed_count",
    "status",
    "unseal",
    "warn_once",
]

_SOURCE = r"""
// tidal storage guard: sets and clears c10::StorageImpl's data-pointer access flag.
#include <c10/core/StorageImpl.h>
#include <cstdint>
#include <string>

namespace {
// Explicit instantiation may name private members: the standard way to reach the flag and
// the member that recomputes the storage's combined check without patching torch.
template <typename Tag, typename Tag::type Member>
struct Reach {
  friend typename Tag::type get(Tag) { return Member; }
};
struct ThrowFlag {
  using type = bool c10::StorageImpl::*;
  friend type get(ThrowFlag);
};
struct RefreshCheck {
  using type = void (c10::StorageImpl::*)();
  friend type get(RefreshCheck);
};
struct DataPtrMember {
  using type = c10::DataPtr c10::StorageImpl::*;
  friend type get(DataPtrMember);
};
template struct Reach<ThrowFlag, &c10::StorageImpl::throw_on_immutable_data_ptr_>;
template struct Reach<RefreshCheck, &c10::StorageImpl::refresh_has_data_ptr_check>;
template struct Reach<DataPtrMember, &c10::StorageImpl::data_ptr_>;

c10::StorageImpl* impl(void* p) { return static_cast<c10::StorageImpl*>(p); }
}  // namespace

extern "C" {
// Set the flag with this message; free the memory first if `free_memory` (size kept).
int tidal_guard_seal(void* p, const char* message, int free_memory) {
  try {
    c10::StorageImpl* s = impl(p);
    if (free_memory) {
      c10::Device device = (s->*get(DataPtrMember{})).device();
      s->set_data_ptr_noswap(c10::DataPtr(nullptr, device));  // the allocator frees the block
    }
    s->release_data_and_set_meta_custom_data_ptr_error_msg_(std::string(message));
    return 0;
  } catch (...) {
    return -1;
  }
}
// Clear the flag; with `empty`, a storage without memory gets size 0 (resize_ allocates it).
int tidal_guard_unseal(void* p, int empty) {
  c10::StorageImpl* s = impl(p);
  s->*get(ThrowFlag{}) = false;
  (s->*get(RefreshCheck{}))();
  if (empty && (s->*get(DataPtrMember{})).get() == nullptr) {
    s->set_nbytes(static_cast<size_t>(0));
  }
  return 0;
}
int tidal_guard_is_sealed(void* p) { return impl(p)->*get(ThrowFlag{}) ? 1 : 0; }
uintptr_t tidal_guard_address(void* p) {
  return reinterpret_cast<uintptr_t>((impl(p)->*get(DataPtrMember{})).get());
}
}
"""

_lock = threading.Lock()
_lib: ctypes.PyDLL | None = None
_reason: str | None = None  # why there is no guard (None: not tried yet, or built)
_tried = False
_warned = False
# The storages sealed here now: key (the StorageImpl's address) -> (a weak reference whose
# callback drops the entry when the storage dies, so no later storage at that address is
# taken for it; whether its memory was freed). Read on every lookup tidal makes (a dict
# lookup, no call into the library). torch keeps one Python storage object per StorageImpl
# alive as long as the StorageImpl, so the reference dies with the storage itself.
_sealed: dict[int, tuple[weakref.ref, bool]] = {}


def _forget(key: int, ref: weakref.ref) -> None:
    held = _sealed.get(key)
    if held is not None and held[0] is ref:
        del _sealed[key]


def _note(storage: torch.UntypedStorage, freed: bool) -> None:
    key = storage._cdata
    held = _sealed.get(key)
    if held is not None and held[0]() is storage:
        _sealed[key] = (held[0], freed)
        return
    _sealed[key] = (weakref.ref(storage, lambda r, k=key: _forget(k, r)), freed)


def _cache_dir() -> str:
    root = os.environ.get("TIDAL_CACHE_DIR")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tidal")
    return root


def _torch_dirs() -> tuple[str, str]:
    base = os.path.dirname(torch.__file__)
    return os.path.join(base, "include"), os.path.join(base, "lib")


def _build() -> str:
    """Compile the library (once per torch build and source) and return its path."""
    include, lib = _torch_dirs()
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    tag = f"{_SOURCE}|{torch.__version__}|{torch.version.git_version}|{abi}|{include}"
    name = f"storage_guard-{hashlib.sha1(tag.encode()).hexdigest()[:16]}.so"
    for root in (_cache_dir(), os.path.join(tempfile.gettempdir(), f"tidal-{os.getuid()}")):
        path = os.path.join(root, name)
        if os.path.exists(path):
            return path
        try:
            os.makedirs(root, exist_ok=True)
        except OSError:
            continue
        if os.access(root, os.W_OK):
            break
    else:
        raise RuntimeError("no writable cache directory (set TIDAL_CACHE_DIR)")
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        raise RuntimeError("no C++ compiler found (install g++, or set CXX)")
    if not os.path.exists(os.path.join(include, "c10", "core", "StorageImpl.h")):
        raise RuntimeError(f"torch's C++ headers are missing ({include})")
    fd, src = tempfile.mkstemp(suffix=".cpp", dir=root)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with os.fdopen(fd, "w") as f:
            f.write(_SOURCE)
        cmd = [cxx, "-O2", "-std=c++17", "-fPIC", "-shared", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
        cmd += ["-I", include, src, "-o", tmp, f"-L{lib}", "-lc10", f"-Wl,-rpath,{lib}"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{os.path.basename(cxx)} failed: {done.stderr.strip()[-600:]}")
        os.replace(tmp, path)  # atomic: a concurrent builder finds a whole library or none
    finally:
        for leftover in (src, tmp):
            if os.path.exists(leftover):
                os.remove(leftover)
    return path


def _load(path: str) -> ctypes.PyDLL:
    # PyDLL: the calls hold the GIL (they take microseconds), so no Python thread runs an op
    # while a flag changes under it.
    lib = ctypes.PyDLL(path)
    lib.tidal_guard_seal.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    lib.tidal_guard_seal.restype = ctypes.c_int
    lib.tidal_guard_unseal.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.tidal_guard_unseal.restype = ctypes.c_int
    lib.tidal_guard_is_sealed.argtypes = [ctypes.c_void_p]
    lib.tidal_guard_is_sealed.restype = ctypes.c_int
    lib.tidal_guard_address.argtypes = [ctypes.c_void_p]
    lib.tidal_guard_address.restype = ctypes.c_size_t
    return lib


def _self_test(lib: ctypes.PyDLL) -> None:
    """Raise unless the library behaves as documented on a scratch storage."""
    t = torch.arange(16, dtype=torch.float32)
    st = t.untyped_storage()
    if lib.tidal_guard_seal(st._cdata, b"tidal guard self-test", 1) != 0:
        raise RuntimeError("sealing a storage failed")
    if not lib.tidal_guard_is_sealed(st._cdata) or st.nbytes() != 64 or lib.tidal_guard_address(st._cdata) != 0:
        raise RuntimeError("a released storage did not read as sealed, sized and without memory")
    try:
        t.sum()
    except RuntimeError as e:
        if "tidal guard self-test" not in str(e):
            raise RuntimeError(f"a read of a sealed storage raised torch's own error: {e}") from None
    else:
        raise RuntimeError("a read of a sealed storage did not raise")
    lib.tidal_guard_unseal(st._cdata, 1)
    if lib.tidal_guard_is_sealed(st._cdata) or st.nbytes() != 0:
        raise RuntimeError("an unsealed storage did not read as open and empty")
    st.resize_(64)
    t.copy_(torch.arange(16, dtype=torch.float32))
    if float(t.sum()) != 120.0:
        raise RuntimeError("an unsealed storage did not hold its bytes again after resize_")


def _get() -> ctypes.PyDLL | None:
    global _lib, _reason, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            if os.environ.get("TIDAL_STORAGE_GUARD", "").lower() in ("0", "off", "false", "no"):
                raise RuntimeError("turned off by TIDAL_STORAGE_GUARD")
            lib = _load(_build())
            _self_test(lib)
            _lib = lib
        except Exception as e:  # noqa: BLE001 (any failure means: no guard, said once)
            _reason = str(e) or type(e).__name__
        _tried = True
    return _lib


def available() -> bool:
    """Whether moved-out storages are guarded (builds the library on the first call)."""
    return _get() is not None


def status() -> str:
    """One line: whether storages are guarded, and if not, why."""
    return "guarded" if available() else f"not guarded: {_reason}"


def warn_once() -> None:
    """Warn (once per process) that moved-out storages are not guarded, and why."""
    global _warned
    if available() or _warned:
        return
    _warned = True
    warnings.warn(
        f"tidal could not set up its storage guard ({_reason}): code outside tidal that reads a tensor "
        f"of a moved-out role can now crash the process (a segfault, or on a GPU an illegal-address "
        f"error that poisons the CUDA context) instead of raising. Install a C++ compiler (g++) so "
        f"tidal can build it, or use tidal.strict_access() to find such reads",
        RuntimeWarning,
        stacklevel=3,
    )


def release(storage: torch.UntypedStorage, message: bytes) -> None:
    """Free ``storage``'s memory and seal it: every access to its bytes raises
    ``RuntimeError(message)``. It keeps its size. Without a guard: ``resize_(0)``."""
    lib = _get()
    if lib is None:
        storage.resize_(0)
        return
    if lib.tidal_guard_seal(storage._cdata, message, 1) != 0:
        raise MemoryError("tidal could not seal a storage")
    _note(storage, True)


def seal(storage: torch.UntypedStorage, message: bytes) -> None:
    """Seal ``storage`` and keep its memory (bytes not its own yet, or about to be unmapped)."""
    lib = _get()
    if lib is None:
        return
    if lib.tidal_guard_seal(storage._cdata, message, 0) != 0:
        raise MemoryError("tidal could not seal a storage")
    _note(storage, False)


def unseal(storage: torch.UntypedStorage, *, empty: bool) -> None:
    """Let ``storage`` be accessed again. ``empty``: one without memory gets size 0, the state
    ``resize_(nbytes)`` allocates from. A storage that is not sealed here is left as it is
    (but with ``empty``, still gets size 0 if it has no memory)."""
    lib = _get()
    if lib is None:
        return
    if _sealed.pop(storage._cdata, None) is not None or empty:
        lib.tidal_guard_unseal(storage._cdata, int(empty))


def is_sealed(storage: torch.UntypedStorage) -> bool:
    """Whether tidal sealed ``storage`` (every access to its bytes raises)."""
    return storage._cdata in _sealed


def is_freed(storage: torch.UntypedStorage) -> bool:
    """Whether tidal sealed ``storage`` and freed its memory (it keeps only its size)."""
    held = _sealed.get(storage._cdata)
    return held is not None and held[1]


def flag_set(storage: torch.UntypedStorage) -> bool:
    """Whether the storage's own flag is set (sealed by tidal or by torch): what a read checks."""
    lib = _get()
    return lib is not None and bool(lib.tidal_guard_is_sealed(storage._cdata))


def sealed_count() -> int:
    """How many storages tidal has sealed now (0: none, so no lookup is needed)."""
    return len(_sealed)


def address(storage: torch.UntypedStorage) -> int:
    """The device address of ``storage``'s memory (0 if it has none), sealed or not."""
    lib = _get()
    if lib is None:
        return storage.data_ptr()
    return int(lib.tidal_guard_address(storage._cdata))
