"""Two bench processes that start each training step together (``bench_trl.py --lockstep``).

A paired comparison in one process alternates TRL alone and tidal in time, and the host's speed
drifts between the two runs of a pair (a host-bound decode's token went from 79 to 36 ms within
one process on an H100 machine, 2026-11-27). Here two processes, one a GPU of one machine, run
complementary sequences (where one runs TRL alone, the other runs tidal, and the next run
swaps them) and wait for each other at the start of every step: each step of tidal then runs
beside a step of TRL alone under the same host, and the GPU each side runs on alternates run by
run. ``pool_paired.py --lockstep`` pairs those steps.

With ``--turns`` the two processes share one GPU and take turns instead: each step of one runs
while the other waits, and in each pair of steps (the n-th of each process) the one that goes
first alternates with n. A step of tidal and the TRL step next to it then run on the same GPU,
a step apart in time, without the other's decode beside it on the host (:meth:`Lockstep.turn`).

The rendezvous is a ``torch.distributed.TCPStore`` on the host (no process group, no
accelerator). A partner that does not come within ``timeout_s`` (it died, or its deadline ended
its run sooner) leaves this process on its own: the step is recorded as not in lockstep, and no
later step waits again.
"""

from __future__ import annotations

import time
from datetime import timedelta

__all__ = ["Lockstep", "parse_address"]


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port); ``ValueError`` naming the expected form otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--lockstep {text!r}: give HOST:PORT, e.g. 127.0.0.1:29611")
    return host, int(port)


class Lockstep:
    """``rank`` 0 hosts the store at ``address`` (``HOST:PORT``), rank 1 connects to it (waiting
    up to ``timeout_s`` for it to appear). :meth:`barrier` returns once both processes reached
    the same key, or after ``timeout_s`` without the partner (then False, and every later
    barrier returns False at once)."""

    WORLD = 2

    def __init__(self, address: str, rank: int, *, timeout_s: float = 300.0) -> None:
        if rank not in (0, 1):
            raise ValueError(f"--lockstep-rank {rank}: two processes step together, ranks 0 and 1")
        import torch.distributed as dist

        host, port = parse_address(address)
        self.rank, self.timeout_s = rank, timeout_s
        self.lost = False
        self._slot = 0  # turns: the slot of this process's step now
        self._open = False  # turns: a step of this process is running (its turn not ended)
        self.store = dist.TCPStore(
            host,
            port,
            world_size=self.WORLD,
            is_master=rank == 0,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )

    def _wait(self, key: str, timeout_s: float) -> bool:
        """Block until ``key`` is set in the store, at most ``timeout_s``: one request the store
        answers when the key comes, so a process that waits the length of its partner's step
        sends nothing meanwhile (polling it took the store's thread, inside the partner's
        process when rank 0 hosts it, hundreds of wake-ups a second)."""
        try:
            self.store.wait([key], timedelta(seconds=max(timeout_s, 1e-3)))
            return True
        except RuntimeError:  # torch.distributed.DistStoreError: not set in time (or the store gone)
            return False

    def _add(self, key: str, n: int) -> int | None:
        """The store's ``add``; None where the store is gone (rank 0, which hosts it, ended):
        this process is on its own from then on."""
        try:
            return int(self.store.add(key, n))
        except RuntimeError:  # torch.distributed.DistNetworkError
            self.lost = True
            return None

    def _set(self, key: str) -> None:
        try:
            self.store.set(key, "1")
        except RuntimeError:  # the store is gone: see _add
            self.lost = True

    def barrier(self, key: str, *, timeout_s: float | None = None) -> tuple[bool, float]:
        """Wait at ``key`` for the partner, at most ``timeout_s`` (default: the constructor's):
        (whether both met there, seconds waited)."""
        t0 = time.perf_counter()
        if self.lost:
            return False, 0.0
        came = self._add(key, 1)
        if came is None:
            return False, time.perf_counter() - t0
        if came >= self.WORLD:
            self._set(key + "/all")  # the second to come releases the first
        elif not self._wait(key + "/all", self.timeout_s if timeout_s is None else timeout_s):
            self._add(key + "/gone", 1)
            self.lost = True
            return False, time.perf_counter() - t0
        # The partner may have given up on this key before we came: then it is not a pair.
        met = self._add(key + "/gone", 0) == 0
        if not met:
            self.lost = True
        return met, time.perf_counter() - t0

    def turn(self, n: int, *, timeout_s: float | None = None) -> tuple[bool, float, int]:
        """Turns: wait until this process's ``n``-th step (counted from 0 over all its runs) may
        run: in the ``n``-th pair rank ``n % 2`` goes first, the other once the first has called
        :meth:`end_turn`. Returns (whether the turn came, seconds waited, 0 if this process goes
        first in the pair else 1). Without the partner within ``timeout_s`` (default: the
        constructor's): False, and no later turn waits."""
        order = 0 if self.rank == n % 2 else 1
        t0 = time.perf_counter()
        if self.lost:
            return False, 0.0, order
        self._slot = 2 * n + order  # the steps of both processes before this one
        if self._slot > 0 and not self._wait(f"turns/{self._slot}", self.timeout_s if timeout_s is None else timeout_s):
            self.lost = True
            return False, time.perf_counter() - t0, order
        self._open = True
        return True, time.perf_counter() - t0, order

    def end_turn(self) -> None:
        """Turns: this process's step is over (its device work finished): the partner's next.
        Nothing where no turn is open (called again after a step that ended in an error)."""
        if self._open and not self.lost:
            self._set(f"turns/{self._slot + 1}")
        self._open = False

    def agree(self, key: str, flag: bool, *, timeout_s: float | None = None) -> bool:
        """Whether either process raised ``flag`` at ``key`` (e.g. "another step would pass the
        deadline"), so that both decide alike and neither waits for a step the other will not
        run. Without the partner: ``flag``."""
        if self.lost:
            return flag
        if flag:
            self._add(key + "/flag", 1)
        met, _ = self.barrier(key, timeout_s=timeout_s)
        return flag or (met and (self._add(key + "/flag", 0) or 0) > 0)
