"""Device-to-host copies handed to the copy engine one piece at a time, so that the compute
stream's own small reads get through between the pieces.

Why: a GPU's device-to-host copy engine serves copies in the order they reach it, across
streams. A copy the compute stream queues (``tensor.item()``: Hugging Face generation reads one
per token to see whether every sequence has finished) therefore waits for every device-to-host
byte queued before it on any stream, whatever the size of the pieces it is queued in. When a
write-back of gigabytes is queued at once behind generation, its first token waits for all of
it (``benchmarks/bench_copy_contention.py`` on an H100, 8 GiB queued in 16 MiB copies: a read
waited 151 ms; 16 GiB: 306-348 ms).

How: a paced copy is split into pieces of at most ``piece_bytes``. Before each piece, the copy
stream waits for the piece before it (of any paced copy on this stream) to have finished, so
the engine holds at most one piece of this stream at a time, and a read queued meanwhile is
served right after that piece. The wait goes through a relay stream (the relay waits on the
previous piece's event and records one the copy stream waits on) because a stream's wait on
its own event may be treated as already met by stream order, which would queue every piece at
once again. There is no host wait and no host thread: everything is queued at once by the
caller, and every byte still moves in stream order on the copy stream, so the pacing changes
when copies run, never what they copy or what waits on them (events recorded on the copy
stream after a paced copy still mark it done).

Measured on an H100 (``bench_copy_contention.py --chained 64:1``, 8 GiB device to host, run f2
of 2026-11-26): the copy ran at 1.01x the line rate, and a decode-like loop's per-iteration
read waited at most 1.54 ms (median 1.23 ms: one piece) instead of 151 ms. Letting two pieces
be queued ahead (depth 2) gave the waits back (147 ms): the engine then always has the next
piece ready before the read. A host thread opening device-side gates piece by piece worked as
well while the host was idle, but ran the copy at 0.49-0.55x the line rate while the main
thread held the GIL, as a launch-heavy host (generation) does.

Cost: per piece, two events recorded and two stream waits queued (host time, about 40 us);
nothing on the device beyond the relay stream.
"""

from __future__ import annotations

from typing import Any

import torch

from tidal.device import DeviceOps

__all__ = ["CopyPacer"]


class CopyPacer:
    """Paces the device-to-host copies queued on one copy stream (see the module docstring).

    One per copy stream, shared by everything that queues paced copies on it (a
    :class:`~tidal.transfer.context.TransferContext` holds the one for its D2H stream), so the
    pieces of two callers are chained too. The caller queues on ``stream`` (inside
    ``ops.on_stream(stream)``); :meth:`copy` queues a copy's pieces, each behind the one before.
    The pacing is a matter of timing only: a missing or extra wait here changes when a piece
    runs, never which bytes it reads.
    """

    def __init__(self, ops: DeviceOps, stream: Any) -> None:
        if stream is None:
            raise ValueError("a CopyPacer paces the copies of a device stream: pass the copy stream, not None")
        self.ops = ops
        self.stream = stream
        self.relay = ops.new_stream()
        # The event after the last paced piece queued on the stream (None: no piece yet). One
        # event per piece: a stream wait reads the event's latest record when it is queued.
        self._last_piece_done: Any = None
        self.pieces = 0  # paced pieces queued so far (telemetry)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, piece_bytes: int) -> None:
        """Queue ``dst.copy_(src)`` (two 1-D uint8 tensors of one length, one on the host) on
        the stream as pieces of at most ``piece_bytes``, each released to the copy engine only
        once the paced piece before it has finished. Must be called with the stream current."""
        assert dst.dtype == torch.uint8 and src.dtype == torch.uint8 and dst.dim() == 1 and src.dim() == 1
        assert dst.numel() == src.numel() and piece_bytes > 0
        n = dst.numel()
        for start in range(0, n, piece_bytes):
            end = min(n, start + piece_bytes)
            self._gate()
            dst[start:end].copy_(src[start:end], non_blocking=True)
            done = self.ops.new_event()
            done.record(self.stream)
            self._last_piece_done = done
            self.pieces += 1

    def _gate(self) -> None:
        """Make the stream's next work wait until the last paced piece has run."""
        before = self._last_piece_done
        if before is None:
            return
        # The relay stream's wait ends when the piece before has run (a semaphore the copy
        # engine releases), not merely when it was queued.
        self.ops.wait_event("pace_relay_after_piece", self.relay, before)
        gate = self.ops.new_event()
        gate.record(self.relay)
        # The copy engine gets the next piece only once the one before has run: a read queued
        # on another stream meanwhile goes first.
        self.ops.wait_event("pace_piece_after_piece", self.stream, gate)
