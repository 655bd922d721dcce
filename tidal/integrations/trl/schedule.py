"""What each turn of a TRL step keeps on the device and what comes in ahead of the next:
:class:`KeepAndPrefetch`, a mixin of :class:`~tidal.integrations.trl.trainer.TidalRLTrainer`
(``TidalConfig.prefetch``)."""

from __future__ import annotations

from tidal.memory import phase_need_bytes

__all__ = ["KeepAndPrefetch"]


class KeepAndPrefetch:
    """Reads the trainer's ``timeshare``, ``tidal_config``, ``_tidal_memory`` (a
    :class:`~tidal.integrations.trl.memory.PhaseMemory`, None off an accelerator),
    ``_tidal_depth`` (how many phases are open) and ``_tidal_gathered`` (see
    :meth:`_allocated_up_front`)."""

    def _keep_free(self, role: str, phase: str) -> int | None:
        """With ``prefetch``: the bytes the turn of ``role`` for ``phase`` keeps free beside it
        instead of switching every other role out: what the phase allocated the last time it
        ran (the loss's: with the backward and optimizer step after it, outside the allocator's
        fragments), plus 10% and 256 MiB. The roles that fit beside that stay on the device:
        the policy through the reference's (and a reward model's) scoring, so the loss needs no
        copy of it back in; the frozen reference through the loss and the next generation where
        the device has room for it too (nothing moves then). The others go, least recently
        used first (a frozen role dropped without a copy). None (every other role goes, as
        without prefetch) before the phase has run once, or where ``prefetch_peak_bytes``
        leaves no room for that beside what is allocated now."""
        cfg, memory, ts = self.tidal_config, self._tidal_memory, self.timeshare
        if not cfg.prefetch or memory is None or role not in ts.roles:
            return None
        if self._tidal_depth > 0 and ts.is_resident(role):
            return 0  # inside a phase that made the room already (the loss's policy log-probs): move nothing
        # The loss's turn also holds the policy through the backward and the optimizer step
        # after it, a phase of its own: both count (their sum bounds what the turn allocates,
        # as the backward starts with what the loss left allocated).
        phases = ("loss", "backward") if phase == "loss" else (phase,)
        growths = [memory.growth.get(p) for p in phases]
        if None in growths:
            return None
        need = phase_need_bytes(sum(growths))
        if cfg.prefetch_peak_bytes is not None:
            # The bound is on allocated bytes: the phase's need counts, the fragments below
            # (free memory, though of no use to large blocks) do not.
            coming = ts.bytes_to_load(role)  # what a prefetch brought in is allocated already
            ahead = 0
            if phase == "loss" and cfg.optimizer_residency == "step":
                # The backward's growth leaves out the optimizer state its prefetch brought in;
                # with "step" residency the step brings all of it in anyway, so it counts here.
                # (Streamed, the prefetch brings in only what the bound leaves beside the roles
                # kept, and the chunks after it are in the growth.)
                ahead = memory.brought_in.get("backward", 0)
            if memory.allocated() + coming + need + ahead > cfg.prefetch_peak_bytes:
                return None
        if phase == "loss":
            # The backward allocates large blocks: free pieces of the allocator's partly used
            # segments do not count as room for keeping a role beside it (Qwen2-7B, 64 x 256, H100, 2026-11-26: 2.71 GiB of
            # cached free memory could not hold a 612 MiB block), only the driver's free memory
            # and the whole free segments the allocator can give back to it.
            return need + self._fragments("loss", "backward")
        return need

    def _after(self, role: str) -> str:
        """The role TRL computes with after ``role``'s phase: generation (policy), reference
        scoring, reward models, then the loss (policy); the roles it does not have are skipped."""
        order = [r for r in ("reference", "reward") if r in self.timeshare.roles] + ["policy"]
        return order[0] if role == "policy" else order[order.index(role) + 1]

    def _prefetch(self, phase: str, then: str, *, growth: int | None = None) -> None:
        """With ``TidalConfig(prefetch=True)``: start bringing ``then`` in behind ``phase``
        (``"optimizer"``: the policy's optimizer state, ahead of its step), leaving free what
        ``phase`` allocated the last time it ran less what of it is allocated already
        (:meth:`_allocated_up_front`; or ``growth`` bytes), +10%, 256 MiB; behind the backward
        also the allocator's fragments (:meth:`_fragments`), behind the generation the most
        they reached in the last one. Under ``prefetch_peak_bytes`` (a bound on allocated
        bytes) it brings in at most the bound less what is allocated and what the phase will
        still allocate: the fragments are free memory, and do not take from it."""
        ts, cfg = self.timeshare, self.tidal_config
        if not cfg.prefetch:
            return
        if then == "optimizer":
            if "policy" not in ts.roles:
                return
        elif then not in ts.roles or len(ts.roles) < 2:
            return
        leave, limit = None, None
        memory = self._tidal_memory
        if memory is not None:
            if growth is None:
                growth = memory.growth.get(phase)
                if growth is None:
                    return  # its needs are not known yet: measured this time, used the next
                if memory.phase == phase:
                    # Started inside the phase: what it allocated already is not left free
                    # twice (at 14B on 2 H100s the reference could not come in behind
                    # generation for it, 2026-11-27).
                    growth = max(0, growth - self._allocated_up_front(phase))
            need = phase_need_bytes(growth)
            leave = need
            if then == "optimizer":
                # Brought in as the backward starts, whose large blocks (the activations' and
                # weights' gradients) the free pieces of the allocator's partly used segments
                # cannot hold: as for the loss's keep, those do not count as the backward's room.
                leave += self._fragments("backward")
            elif phase == "generate":
                # Nor can the pieces the last generation's own growing KV cache left in them hold
                # its next blocks: a 32B shape's second generation on 4 H100s ran out of memory
                # asking for 158 MiB with 1.09 GiB of them free (2026-11-28). Those its prefetch
                # found there (the backward's) stay counted as room: its role's blocks are small.
                leave += memory.fragments.get("generate", 0)
            if cfg.prefetch_peak_bytes is not None:
                # The bound is on allocated bytes: what the phase will still allocate counts,
                # the fragments left free beside it do not (they are free memory, not
                # allocated). Counted here, the ~6 GiB of them a 1.5B step's backward leaves
                # (read again in the next generation) took as much of the reference out of the
                # generation's prefetch under a 17 GiB bound.
                limit = max(0, cfg.prefetch_peak_bytes - memory.allocated() - need)
        if then == "optimizer":
            rec = ts.prefetch_optimizer("policy", leave_free_bytes=leave, limit_bytes=limit)
        else:
            # Written back ahead: only what the turn of `then` will move out (the policy's
            # after the scoring is the loss's).
            keep = self._keep_free(then, "loss" if then == "policy" else then)
            rec = ts.prefetch(then, leave_free_bytes=leave, limit_bytes=limit, keep_free_bytes=keep)
        if rec is not None and memory is not None:
            memory.prefetched(rec.bytes_in)

    def _allocated_up_front(self, phase: str) -> int:
        """What the running ``phase`` allocated before its first forward that its growth the
        last time held too: an FSDP2 policy gathered whole for generation, where the last
        generation gathered it as well (``_tidal_gathered``: the bytes gathered for this
        generation and for the last, 0 where per unit). Nothing otherwise: a generation
        gathered now after one that gathered per unit has that growth still to come (its KV
        cache)."""
        now, last = self._tidal_gathered
        if phase != "generate" or not now or now != last or self._tidal_memory is None:
            return 0
        return min(now, self._tidal_memory.grown())

    def _room_for_backward(self, need: int | None) -> None:
        """With ``prefetch``: right before the backward, the loss's activations now allocated,
        move out what it takes to leave the backward's need (``need``:
        :meth:`~tidal.integrations.trl.memory.PhaseMemory.backward_need`, +10%, 256 MiB) free outside the allocator's
        fragments. A role the loss's turn kept on the last step's reading (a longer batch makes
        larger activations) goes now, a frozen one dropped without a copy; where the room is
        there, this reads the free memory and moves nothing."""
        cfg, ts = self.tidal_config, self.timeshare
        if not cfg.prefetch or need is None or "policy" not in ts.roles or len(ts.resident_roles) < 2:
            return
        ts.load("policy", keep_free_bytes=phase_need_bytes(need) + self._fragments("backward"))

    def _fragments(self, *phases: str) -> int:
        """The room the allocator's fragments take from a large block: those there now, or, if
        more, the most they reached in ``phases`` the last time they ran (a backward that
        splits segments as it goes, FSDP2's, leaves pieces its later blocks cannot use: 2.92
        GiB of them when a 14B-shape step ran out of memory on an H100, 2026-11-27)."""
        now = self.timeshare.ops.fragmented_free_bytes()
        memory = self._tidal_memory
        if memory is None:
            return now
        return max([now] + [memory.fragments.get(p, 0) for p in phases])
