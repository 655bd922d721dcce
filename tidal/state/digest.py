"""Content digests of storages, computed where the bytes are (device or host).

Used to verify that state comes back exactly as it went out (``TransferConfig.verify``): a
digest of the device bytes is taken when a storage is offloaded and compared with a digest of
the device bytes after it is reloaded, so corruption anywhere on the way (host memory, either
copy) is caught.

The digest is a position-weighted sum modulo 2**64 of the storage read as 64-bit words (the
tail bytes weighted separately, the length added): every word is multiplied by an odd constant
that depends on its position, so flipped bits, swapped words and shifted runs all change it
(not a cryptographic hash: it guards against accidents, not adversaries). Integer arithmetic
wraps the same on every device, so a digest computed on the host equals the one computed on
the device for the same bytes, whatever the order of the sum.

Cost: ``"full"`` reads the bytes once on the device, in blocks of ``BLOCK_WORDS`` (one block's
product is the only temporary); on a GPU that runs at HBM bandwidth, tens of times the PCIe
rate. ``"sampled"`` reads ``SAMPLE_WORDS`` words at fixed positions spread over the storage
(it catches corruption of pages or regions, not a single flipped bit).

:func:`digest_many` digests many storages at once. On a CUDA device with Triton it is one
kernel over all of them (plus a segment sum): the per-storage path launches about ten kernels
per storage, which for a model's few hundred parameters costs more host time than the read.
Both paths compute the same value.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch

from tidal import guard
from tidal.state import digest_kernel
from tidal.transfer.engine import byte_view

__all__ = ["digest", "digest_many", "VerifyMode"]

VerifyMode = Literal["off", "sampled", "full"]

BLOCK_WORDS = 2 << 20  # 16 MiB of words per block: bounds the temporary
_COLS = 4096
SAMPLE_WORDS = _COLS  # one column weight per sampled word
_TAIL = 0x1E3779B97F4A7C15
_weights: dict[torch.device, torch.Tensor] = {}


def _column_weights(device: torch.device) -> torch.Tensor:
    w = _weights.get(device)
    if w is None:
        g = torch.Generator().manual_seed(0x7ADA1)
        w = (torch.randint(0, 2**62, (_COLS,), generator=g, dtype=torch.int64) * 2 + 1).to(device)
        _weights[device] = w
    return w


def digest(x: torch.Tensor, mode: VerifyMode = "full") -> torch.Tensor:
    """The digest of ``x`` (a 1-D ``uint8`` tensor: a storage's bytes) as a 0-d ``int64``
    tensor on ``x``'s device, computed on that device's current stream (no synchronisation)."""
    assert x.dtype == torch.uint8 and x.dim() == 1, (x.dtype, x.shape)
    assert mode in ("sampled", "full"), mode
    n = x.numel()
    w = _column_weights(x.device)
    nwords = n // 8
    total = torch.zeros((), dtype=torch.int64, device=x.device)
    if nwords:
        head = x[: nwords * 8]
        words = (head if x.storage_offset() % 8 == 0 else head.clone()).view(torch.int64)
        if mode == "sampled" and nwords > SAMPLE_WORDS:
            # Fixed positions, spread evenly with a phase that depends on the storage's size.
            stride = nwords // SAMPLE_WORDS
            phase = (nwords * 2654435761) % stride
            pos = torch.arange(SAMPLE_WORDS, device=x.device, dtype=torch.int64) * stride + phase
            total = total + (words[pos] * w * (pos * 2 + 1)).sum()
        else:
            for start in range(0, nwords, BLOCK_WORDS):
                block = words[start : start + BLOCK_WORDS]
                full = block.numel() // _COLS * _COLS
                if full:
                    rows = (block[:full].view(-1, _COLS) * w).sum(dim=1)
                    first_row = start // _COLS  # BLOCK_WORDS is a multiple of _COLS
                    rank = torch.arange(first_row, first_row + rows.numel(), device=x.device, dtype=torch.int64)
                    total = total + (rows * (rank * 2 + 1)).sum()
                rest = block[full:]
                if rest.numel():
                    total = total + (rest * w[: rest.numel()]).sum() * (2 * (start + full) + 3)
    tail = x[nwords * 8 :]
    if tail.numel():
        total = total + (tail.to(torch.int64) * w[: tail.numel()]).sum() * _TAIL
    return total + n  # the length too: a truncated copy differs even if the lost bytes were zero


def digest_many(items: Sequence[torch.Tensor | torch.UntypedStorage], mode: VerifyMode = "full") -> torch.Tensor:
    """:func:`digest` of each of ``items`` (storages, or 1-D ``uint8`` tensors, on one device) as
    a 1-D ``int64`` tensor on that device, queued on its current stream (no synchronisation).
    On CUDA with Triton installed, every item 8-byte aligned: one kernel for all of them (two
    for ``"sampled"``: the storages it samples, and the small ones it reads whole); otherwise
    one :func:`digest` per item. Memory: a few bytes per chunk of input.
    Raises ``ValueError`` for an empty sequence."""
    if not items:
        raise ValueError("digest_many needs at least one storage or tensor")
    device = items[0].device
    if device.type == "cuda" and digest_kernel.available():
        spans = []
        for x in items:
            if isinstance(x, torch.UntypedStorage):
                spans.append((guard.address(x), x.nbytes()))  # guarded (arriving) or not
            else:
                assert x.dtype == torch.uint8 and x.dim() == 1 and x.is_contiguous(), (x.dtype, x.shape)
                spans.append((x.data_ptr(), x.numel()))
        if all(x.device == device for x in items) and all(addr % 8 == 0 for addr, _ in spans):
            return digest_kernel.digest_spans(
                spans, device, _column_weights(device), cols=_COLS, tail_mul=_TAIL, sampled=mode == "sampled"
            )
    return torch.stack([digest(byte_view(x) if isinstance(x, torch.UntypedStorage) else x, mode) for x in items])
