"""The digests of :mod:`tidal.state.digest` as Triton kernels over many storages: ``"full"``
in one kernel, and ``"sampled"`` in one more for the storages it samples.

Each program reads one chunk of ``CHUNK_WORDS`` 64-bit words of one storage and writes its
partial sum; the partial sums are added per storage (modulo 2**64, so in any order). The value
is the one :func:`tidal.state.digest.digest` computes: for word ``i`` of ``nwords``, with
``full = nwords // cols * cols`` words in complete rows, ``x[i] * w[i % cols] * (2 * (i //
cols) + 1)`` for ``i < full`` and ``x[i] * w[i - full] * (2 * full + 3)`` after; the trailing
``nbytes % 8`` bytes times ``w[k] * tail_mul``; plus ``nbytes``.

Triton is optional (:func:`available`) and imported only when a kernel first runs, on a CUDA
device; without it :mod:`tidal.state.digest` runs the same digests as torch ops.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

__all__ = ["available", "digest_full", "digest_sampled", "digest_spans"]

CHUNK_WORDS = 1 << 18  # 2 MiB of words per program, a whole number of rows


@functools.cache
def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def digest_chunks(
        addr_ptr,
        nbytes_ptr,
        chunk_of_ptr,
        start_ptr,
        w_ptr,
        part_ptr,
        COLS: tl.constexpr,
        CHUNK: tl.constexpr,
        TAIL_MUL: tl.constexpr,
    ):
        c = tl.program_id(0)
        s = tl.load(chunk_of_ptr + c)
        start = tl.load(start_ptr + c)
        n = tl.load(nbytes_ptr + s)
        nwords = n // 8
        full = nwords // COLS * COLS  # words in complete rows
        addr = tl.load(addr_ptr + s)
        words = addr.to(tl.pointer_type(tl.int64))
        end = tl.minimum(start + CHUNK, nwords)
        cols = tl.arange(0, COLS)
        w = tl.load(w_ptr + cols)  # the same column weights for every row
        total = tl.full([], 0, tl.int64)
        # Chunks start at whole rows and full is a whole number of rows, so a step of COLS words
        # covers one complete row or the partial last one (whose weights are w[i - full], the
        # same w[i % COLS]); each is summed, then weighted by its rank.
        for lo in range(start, end, COLS):
            i = lo + cols
            x = tl.load(words + i, mask=i < end, other=0)
            rank = tl.where(lo < full, 2 * (lo // COLS) + 1, 2 * full + 3)
            total += tl.sum(x * w, axis=0) * rank
        if start == 0:  # the chunk that starts the storage adds its tail bytes and its length
            k = tl.arange(0, 8).to(tl.int64)
            tm = k < n - nwords * 8
            b = tl.load(addr.to(tl.pointer_type(tl.uint8)) + nwords * 8 + k, mask=tm, other=0).to(tl.int64)
            wk = tl.load(w_ptr + k, mask=tm, other=0)
            total += tl.sum(b * wk, axis=0) * TAIL_MUL + n
        tl.store(part_ptr + c, total)

    @triton.jit
    def digest_samples(
        addr_ptr, nbytes_ptr, stride_ptr, phase_ptr, w_ptr, out_ptr, COLS: tl.constexpr, TAIL_MUL: tl.constexpr
    ):
        s = tl.program_id(0)
        n = tl.load(nbytes_ptr + s)
        nwords = n // 8
        addr = tl.load(addr_ptr + s)
        k = tl.arange(0, COLS).to(tl.int64)
        pos = k * tl.load(stride_ptr + s) + tl.load(phase_ptr + s)
        x = tl.load(addr.to(tl.pointer_type(tl.int64)) + pos)
        total = tl.sum(x * tl.load(w_ptr + k) * (pos * 2 + 1), axis=0)
        t = tl.arange(0, 8).to(tl.int64)
        tm = t < n - nwords * 8
        b = tl.load(addr.to(tl.pointer_type(tl.uint8)) + nwords * 8 + t, mask=tm, other=0).to(tl.int64)
        total += tl.sum(b * tl.load(w_ptr + t, mask=tm, other=0), axis=0) * TAIL_MUL + n
        tl.store(out_ptr + s, total)

    return digest_chunks, digest_samples


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        # From pinned memory, so the copy is queued behind the stream's work instead of waiting for it.
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _packed(columns: Sequence[Sequence[int]], device: torch.device) -> list[torch.Tensor]:
    """The int64 ``columns`` on ``device`` in one copy, each as a slice that starts 16 bytes
    aligned (each column padded to an even length). Triton specialises a kernel on whether
    each pointer argument is 16-byte aligned: slices at odd offsets would compile (seconds,
    on the host, inside a transition) a new kernel for each mix of counts."""
    flat: list[int] = []
    starts = []
    for col in columns:
        starts.append(len(flat))
        flat.extend(col)
        flat.extend([0] * (len(col) % 2))
    meta = _to_device(flat, device)
    return [meta[a : a + len(col)] for a, col in zip(starts, columns)]


def digest_sampled(
    spans: Sequence[tuple[int, int]], device: torch.device, weights: torch.Tensor, *, cols: int, tail_mul: int
) -> torch.Tensor:
    """The sampled digests of ``spans`` (each more than ``cols`` words; 8-byte aligned), one
    program per storage reading ``cols`` words at the positions the torch path reads."""
    strides, phases = [], []
    for _, nbytes in spans:
        nwords = nbytes // 8
        assert nwords > cols, "a storage of at most `cols` words is digested in full"
        stride = nwords // cols
        strides.append(stride)
        phases.append((nwords * 2654435761) % stride)  # exact on the host: no 64-bit wrap
    ns = len(spans)
    addr_d, size_d, stride_d, phase_d = _packed([[a for a, _ in spans], [n for _, n in spans], strides, phases], device)
    out = torch.empty(ns, dtype=torch.int64, device=device)
    _kernel()[1][(ns,)](addr_d, size_d, stride_d, phase_d, weights, out, COLS=cols, TAIL_MUL=tail_mul)
    return out


def digest_full(
    spans: Sequence[tuple[int, int]], device: torch.device, weights: torch.Tensor, *, cols: int, tail_mul: int
) -> torch.Tensor:
    """The full digests of the device byte ranges ``spans`` (address, bytes; 8-byte aligned
    addresses) as one int64 tensor, queued on the current stream."""
    assert CHUNK_WORDS % cols == 0
    addrs, sizes, chunk_of, starts = [], [], [], []
    for si, (addr, nbytes) in enumerate(spans):
        addrs.append(addr)
        sizes.append(nbytes)
        for start in range(0, max(nbytes // 8, 1), CHUNK_WORDS):
            chunk_of.append(si)
            starts.append(start)
    addr_d, size_d, chunk_d, start_d = _packed([addrs, sizes, chunk_of, starts], device)
    ns, nc = len(spans), len(chunk_of)
    parts = torch.empty(nc, dtype=torch.int64, device=device)
    _kernel()[0][(nc,)](
        addr_d,
        size_d,
        chunk_d,
        start_d,
        weights,
        parts,
        COLS=cols,
        CHUNK=CHUNK_WORDS,
        TAIL_MUL=tail_mul,
        num_warps=8,
    )
    return torch.zeros(ns, dtype=torch.int64, device=device).index_add_(0, chunk_d, parts)


def digest_spans(
    spans: Sequence[tuple[int, int]],
    device: torch.device,
    weights: torch.Tensor,
    *,
    cols: int,
    tail_mul: int,
    sampled: bool,
) -> torch.Tensor:
    """The digests of ``spans`` in order: all full, or (``sampled``) sampled where a storage
    has more than ``cols`` words and full for the others, as the torch path does."""
    big = [i for i, (_, n) in enumerate(spans) if sampled and n // 8 > cols]
    if not big:
        return digest_full(spans, device, weights, cols=cols, tail_mul=tail_mul)
    chosen = set(big)
    small = [i for i in range(len(spans)) if i not in chosen]
    out = torch.empty(len(spans), dtype=torch.int64, device=device)
    parts = [(big, digest_sampled([spans[i] for i in big], device, weights, cols=cols, tail_mul=tail_mul))]
    if small:
        parts.append((small, digest_full([spans[i] for i in small], device, weights, cols=cols, tail_mul=tail_mul)))
    for index, values in parts:
        out.index_copy_(0, _to_device(index, device), values)
    return out
