"""Device-to-host copies handed to the copy engine one piece at a time, so that the compute
stream's own small reads get through between the pieces.

Why: a GPU's device-to-host copy engine serves copies in the order they reach it, across
streams. A copy the compute stream queues (``tensor.item()``: Hugging Face generation reads one
per token to see whether every sequence has finished) therefore waits for every device-to-host
byte queued before it on any stream, whatever the size of the pieces it is queued in. When a
write-back of gigabytes is queued at once behind generation, its first token waits for all of
it (``benchmarks/bench_copy_contention.py`` on an H100, 8 GiB queued in 16 MiB copies: a read
waited 151 ms; 16 GiB: 306-348 ms). In a Qwen2-7B GRPO step on an H200 (2026-11-26, commit 238e67d),
0.51 s of the optimizer state's write-back was still queued when the next generation began.

How: a paced copy is split into pieces of at most ``piece_bytes`` that take turns on two
streams, the copy stream and a second one, each piece's stream waiting (an event) for the piece
before it to have finished. A stream whose next piece waits holds nothing at the copy engine, so
the engine holds at most one piece at a time and a read queued meanwhile is served right after
that piece. After a copy whose last piece ran on the second stream, the copy stream waits for it:
everything queued on the copy stream later (the caller's events, the next staging gather, the
allocator's record of a freed block) still comes after every byte of the copy. There is no host
wait and no host thread; the pacing changes when the pieces run, never what they copy.

Measured on an H100 (``bench_copy_contention.py``, 8 GiB device to host, 2026-11-26),
against every piece queued at once (151 ms):

* chained one ahead, as here (two streams, 64 MiB pieces): the copy at 1.01x the line rate,
  a decode-like loop's read waited at most 1.54 ms (median 1.23 ms: one piece); with 3 ms of
  pure Python per iteration holding the GIL, 0.99x the line rate;
* chained two ahead (three streams): the waits came back (147 ms): the engine then always has
  the next piece ready before the read;
* one stream waiting on its own previous piece, directly or through an event recorded on a
  relay stream that waited for it: the waits stayed (116 ms of a 118 ms copy, H200, 238e67d): such a
  wait is resolved by stream order and holds nothing back;
* a host thread opening device-side gates (``cuStreamWaitValue32``) piece by piece: reads
  through, but the copy at 0.49-0.55x the line rate while the main thread held the GIL, as a
  launch-heavy host (generation) does.

Cost: per piece, one event recorded and one stream wait queued (two of each for a piece on the
second stream: it first waits for the copy stream's position); no device memory.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from tidal.device import DeviceOps

__all__ = ["CopyPacer"]


class CopyPacer:
    """Paces the device-to-host copies queued on one copy stream (see the module docstring).

    One per copy stream, shared by everything that queues paced copies on it (a
    :class:`~tidal.transfer.context.TransferContext` holds the one of its D2H stream), so the
    pieces of two callers take turns too. The caller queues on ``stream`` (inside
    ``ops.on_stream(stream)``); :meth:`copy` queues a copy's pieces and returns with the copy
    stream ordered after all of them.
    """

    def __init__(self, ops: DeviceOps, stream: Any) -> None:
        if stream is None:
            raise ValueError("a CopyPacer paces the copies of a device stream: pass the copy stream, not None")
        self.ops = ops
        self.stream = stream
        self.second = ops.new_stream()
        # The event after the last paced piece and whether it ran on the second stream.
        self._last_piece_done: Any = None
        self._last_on_second = False
        self.pieces = 0  # paced pieces queued so far (telemetry)
        self._lock = threading.Lock()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, piece_bytes: int) -> None:
        """Queue ``dst.copy_(src)`` (two 1-D uint8 tensors of one length, one on the host) as
        pieces of at most ``piece_bytes``, each reaching the copy engine only once the paced
        piece before it has finished. Must be called with the copy stream current; on return
        the copy stream's later work runs after every piece."""
        assert dst.dtype == torch.uint8 and src.dtype == torch.uint8 and dst.dim() == 1 and src.dim() == 1
        assert dst.numel() == src.numel() and piece_bytes > 0
        with self._lock:
            self._copy(dst, src, piece_bytes)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, piece_bytes: int) -> None:
        ops, n = self.ops, dst.numel()
        for start in range(0, n, piece_bytes):
            end = min(n, start + piece_bytes)
            on_second = not self._last_on_second if self._last_piece_done is not None else False
            if on_second:
                here = ops.new_event()
                here.record(self.stream)
                # The second stream reads what the copy stream's work so far wrote (a staging
                # gather, the compute it waited for), and starts once the piece before, queued
                # there, has run: the copy engine gets this piece only then.
                ops.wait_event("pace_piece_after_stream", self.second, here)
                stream = self.second
            else:
                stream = self.stream
                if self._last_piece_done is not None and self._last_on_second:
                    # The piece before ran on the second stream: this one reaches the copy
                    # engine once it has run, so a read queued meanwhile goes first.
                    ops.wait_event("pace_piece_after_piece", stream, self._last_piece_done)
            with ops.on_stream(stream):
                dst[start:end].copy_(src[start:end], non_blocking=True)
                done = ops.new_event()
                done.record(stream)
            self._last_piece_done, self._last_on_second = done, on_second
            self.pieces += 1
        if self._last_on_second:
            # Whatever the copy stream queues next (the caller's event marking this copy done,
            # a staging buffer's reuse, a freed block's record) must come after the last piece.
            ops.wait_event("pace_stream_after_copy", self.stream, self._last_piece_done)

    def synchronize(self) -> None:
        """Block the host until every piece queued has run (also one whose copy stream's wait
        an exception kept from being queued)."""
        if self.second is not None:
            self.second.synchronize()
