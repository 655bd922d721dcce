"""An in-process vLLM engine taking turns with a :class:`~tidal.Timeshare`'s roles:
:class:`VllmEngine`.

vLLM colocated with training (TRL's ``vllm_mode="colocate"``, verl's hybrid engine, ROLL's
actor_infer) holds its own memory: a copy of the policy's weights and a KV cache, in its own
pool in this process. With sleep mode that memory goes back to the driver between generations
(``sleep(level=2)``: both dropped; ``level=1``: the weights backed up on the host) and comes
back with ``wake_up``. What tidal adds is the rest of the hand-over:

* before the engine's weights wake, the room for them is made beside the policy (the roles
  that do not fit beside the engine's memory go: the reference, a reward model);
* once the policy's weights are in the engine, the policy itself (and every other role) goes
  to the host before the KV cache wakes, unless it fits beside the cache and the generation's
  own margin (both read at driver level as they last woke); the freed memory is returned to
  the driver, where vLLM's pool takes it;
* after the engine sleeps, its memory is the driver's again, for the next phase's role.

Two ways to use it. A loop that drives the engine itself (``with engine.generating(policy):
llm.generate(...)``): the weights wake, are pushed from ``policy`` (from the device), the room
for the KV cache is made, and the engine sleeps again at the end. A trainer that drives the
engine (TRL calls ``sleep``, ``wake_up``, ``load_weights`` and ``generate`` itself):
``with engine.driven():`` puts tidal's steps in front of those calls for the block.

Memory cost: none beyond vLLM's own; the roles moved out are held in the timeshare's host
arena as always.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from tidal.device import RandomState
from tidal.errors import InsufficientMemoryError
from tidal.integrations.seams import abort_unfinished, check_engine, instead, load_weights_of
from tidal.integrations.vllm.pool import allocation_bytes, asleep_allocations, is_out_of_memory, put_back_to_sleep
from tidal.memory import phase_need_bytes

__all__ = ["VllmEngine", "kv_bytes_per_token", "kv_cache_bytes_for"]

#: Tokens per block of vLLM's paged KV cache (its default ``block_size``): a sequence takes whole blocks.
KV_BLOCK_TOKENS = 16


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """The KV cache one token takes in a decoder of this Hugging Face ``config`` (every layer's
    key and value for each KV head) in ``dtype``."""
    text = getattr(config, "text_config", None) or config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def kv_cache_bytes_for(config: Any, dtype: torch.dtype, *, sequences: int, max_len: int) -> int:
    """The KV cache that holds ``sequences`` sequences of ``max_len`` tokens at once (each in whole
    blocks of :data:`KV_BLOCK_TOKENS`, beside vLLM's null block) in a decoder of this Hugging Face
    ``config``: a generation of that many sequences never waits for room in it (no request is
    preempted), and nothing is sized from a fraction of the device.

    Raises:
        ValueError: ``sequences`` or ``max_len`` not an int > 0.
    """
    for name, v in (("sequences", sequences), ("max_len", max_len)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"kv_cache_bytes_for: {name} must be an int > 0, got {v!r}")
    blocks = -(-max_len // KV_BLOCK_TOKENS)
    # vLLM's block pool keeps one block that no request gets (its null block): without it the
    # last sequence is preempted as every sequence reaches its longest.
    return (sequences * blocks + 1) * KV_BLOCK_TOKENS * kv_bytes_per_token(config, dtype)


class VllmEngine:
    """vLLM's ``LLM`` (in this process) beside ``timeshare``'s roles (see the module docstring).

    Args:
        llm: the ``vllm.LLM`` (``enable_sleep_mode=True`` for its memory to leave the device
            between generations; without it the engine stays resident and the roles take
            turns in the rest).
        timeshare: the roles' :class:`~tidal.Timeshare`.
        policy: the role whose weights the engine generates with (pushed into it, then moved
            out while it generates unless it fits beside the cache).
        kv_cache_bytes: the engine's KV cache, as it was built with (``kv_cache_memory_bytes``;
            for the reader: the room is the measured one, :attr:`woken`).
        keep_free_bytes: what the generation needs beside the engine's weights and cache (its
            activations, vLLM's sampler). Once both have woken once (their bytes measured at
            driver level then), each turn moves out only what it takes to leave the engine's
            memory (+10%, 256 MiB) and this free, least recently used first, the policy last;
            before that, and with None, every role goes while the engine generates.
        sleep_level: what :meth:`generating` puts the engine to sleep with (2: weights and KV
            cache dropped; 1: weights backed up by vLLM).
        asleep: the engine sleeps now (TRL puts it to sleep as it builds it, with sleep mode).
        peak_bytes: with ``keep_free_bytes``, the device's used memory (driver level) the
            engine's turns stay under: a role is kept beside the engine only where the engine's
            memory and ``keep_free_bytes`` fit under this too. None: free memory decides.

    Raises:
        SeamError: the installed vLLM lacks a surface tidal uses (named, with the versions it is
            tested with).
        ValueError: ``policy`` is not a role of ``timeshare``, or a bad size.
    """

    def __init__(
        self,
        llm: Any,
        timeshare: Any,
        *,
        policy: str = "policy",
        kv_cache_bytes: int = 0,
        keep_free_bytes: int | None = None,
        sleep_level: int = 2,
        asleep: bool = False,
        peak_bytes: int | None = None,
    ) -> None:
        check_engine(llm, who=type(self).__name__)
        if policy not in timeshare.roles:
            raise ValueError(f"VllmEngine: {policy!r} is not a role of the timeshare (roles: {timeshare.roles})")
        if not isinstance(kv_cache_bytes, int) or kv_cache_bytes < 0:
            raise ValueError(f"VllmEngine: kv_cache_bytes must be an int >= 0, got {kv_cache_bytes!r}")
        if sleep_level not in (1, 2):
            raise ValueError(f"VllmEngine: sleep_level must be 1 or 2, got {sleep_level!r}")
        if peak_bytes is not None and (
            not isinstance(peak_bytes, int) or isinstance(peak_bytes, bool) or peak_bytes < 0
        ):
            raise ValueError(f"VllmEngine: peak_bytes must be an int >= 0 or None, got {peak_bytes!r}")
        self.peak_bytes = peak_bytes
        self.llm, self.timeshare, self.policy = llm, timeshare, policy
        self.kv_cache_bytes, self.keep_free_bytes, self.sleep_level = kv_cache_bytes, keep_free_bytes, sleep_level
        self.asleep = asleep  # the engine's weights are not on the device (they slept)
        self.kv_asleep = asleep
        self.moves: list[Any] = []  # the timeshare's transitions made for the engine
        self.woken: dict[str, int] = {}  # tag -> the device bytes its last wake took (driver level)
        self._kv_room = False  # the room for the KV cache was made in this turn already
        self._slept_level = sleep_level  # the level the engine last slept at (TRL's: 2)
        self.oom_retries = 0  # wakes run again after running out of memory, the roles out
        # Tags whose wake (or, for the KV cache, a generation) ran out of memory beside the roles
        # a turn kept: their turns from then on move those roles out first, as the retry did,
        # rather than run out of memory again each time the same way.
        self.out_first: set[str] = set()

    # ---- the hand-over ---------------------------------------------------------------------------
    def _need(self, *tags: str) -> int | None:
        """What waking ``tags`` (those asleep) takes, +10% and 256 MiB, and ``keep_free_bytes``
        beside it, and under ``peak_bytes`` the part of the device above it; None: not kept (no
        ``keep_free_bytes``, or a tag not measured yet)."""
        if self.keep_free_bytes is None:
            return None
        wake = self._wake_bytes(*tags)
        if wake is None:
            return None
        ops = self.timeshare.ops
        above = 0
        if self.peak_bytes is not None:
            above = max(0, ops.driver_free_bytes()[1] - self.peak_bytes)
        # vLLM's pool maps memory from the driver: the free pieces of torch's partly used segments
        # (the backward's fragments) count as free to a role's load but cannot go back to it.
        return wake + self.keep_free_bytes + above + ops.fragmented_free_bytes()

    def _wake_bytes(self, *tags: str) -> int | None:
        """What waking ``tags`` (those asleep) takes at driver level, +10% and 256 MiB (0: all
        awake); None: one of them not measured yet."""
        asleep = {"weights": self.asleep, "kv_cache": self.kv_asleep}
        tags = tuple(t for t in tags if asleep[t])
        if not tags:
            return 0
        if any(t not in self.woken for t in tags):
            return None
        return phase_need_bytes(sum(self.woken[t] for t in tags))

    def asleep_bytes(self) -> int:
        """What of the engine's pool sleeps now (as its wakes measured it): torch's allocator
        keeps counting those bytes as allocated, their memory unmapped, back with the driver."""
        return (self.woken.get("weights", 0) if self.asleep else 0) + (
            self.woken.get("kv_cache", 0) if self.kv_asleep else 0
        )

    def room_for_weights(self) -> None:
        """Before the weights wake: the policy on the device (their source), and the other roles
        out where the engine's weights and KV cache (measured at their last wake) and
        ``keep_free_bytes`` do not fit beside it; every other role before they were measured,
        and, once a wake of the weights ran out of memory beside a kept turn, every role that
        may go and the policy's optimizer state and gradients (:attr:`out_first`)."""
        self._record(self.timeshare.load(self.policy, keep_free_bytes=self._need("weights", "kv_cache")))
        if "weights" in self.out_first and self.asleep:
            self._all_out(["weights"])  # the room a kept turn lacked before: what its retry moved
            return
        self._release(self._wake_bytes("weights"))

    def room_for_kv_cache(self) -> None:
        """Once the weights are in the engine, before its KV cache wakes (or it generates): the
        roles out, least recently used first and the policy last (its weights are the engine's
        now), until the cache (measured at its last wake) and ``keep_free_bytes`` fit; every
        role before it was measured."""
        ts = self.timeshare
        self._kv_room = True
        need = self._need("kv_cache")
        if need is None or "kv_cache" in self.out_first:
            # Nothing measured yet, or a kept turn ran short before: every role that may go goes
            # (a role in use, its phase's in a loop of one's own, stays).
            self._all_out(["kv_cache"])
            return
        order = sorted(ts.resident_roles, key=lambda r: (r == self.policy, ts.role(r).last_used))
        for name in order:
            if self._free_bytes() >= need:
                break
            if ts.role(name).in_use:
                continue
            self._record(ts.offload(name))
            self._release()
        self._release(self._wake_bytes("kv_cache"))

    def _free_bytes(self) -> int:
        """What vLLM's pool could map once torch's cache is released: the driver's free memory
        and the cache's whole free segments (not the pieces of partly used ones)."""
        ops = self.timeshare.ops
        return ops.driver_free_bytes()[0] + ops.cached_free_bytes() - ops.fragmented_free_bytes()

    def _release(self, wake_bytes: int | None = None) -> None:
        """What torch's cache holds goes back to the driver, where vLLM's pool takes its memory
        from; with ``wake_bytes`` (what the next wake takes) only where the driver's own free
        memory is short of it. Releasing waits for every copy out of the device still queued
        (the allocator frees a block only once its copies ran): an optimizer state going to the
        host behind the step would hold the generation up for its whole transfer."""
        ops = self.timeshare.ops
        if wake_bytes is not None and ops.driver_free_bytes()[0] >= wake_bytes:
            return
        ops.empty_cache()

    def release_for_wake(self) -> None:
        """For a trainer that empties the device's cache before it wakes the engine's weights
        (TRL's colocate mode does): the cache released only where the driver lacks the room
        for the wake (measured at its last), so queued copies out are not waited for."""
        self._release(self._wake_bytes("weights"))

    def _record(self, rec: Any) -> None:
        if rec is not None:
            self.moves.append(rec)

    # ---- a loop that drives the engine ---------------------------------------------------------
    def push_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(name, tensor)`` pairs into the engine's weights (vLLM's ``load_weights``, one
        call for all: each tensor is copied where it lies, on the device or from the host)."""
        load_weights_of(self.llm)(list(named))

    @contextlib.contextmanager
    def generating(self, policy: torch.nn.Module, *, names=None) -> Iterator[Any]:
        """The engine awake with ``policy``'s weights for the block, the roles out of its way;
        asleep (``sleep_level``) after it, its memory back with the driver. ``names(name)``
        maps a parameter's name to the engine's (default: as it is). Yields the ``llm``, whose
        ``generate`` in the block leaves no request behind when it raises and runs again after
        running out of memory (:meth:`_generate`)."""
        llm = self.llm
        generate = llm.generate
        if self.asleep:
            self.room_for_weights()
            self._wake(lambda: llm.wake_up(tags=["weights"]), ["weights"])
        with self.timeshare.use(self.policy):
            rename = names or (lambda n: n)
            self.push_weights((rename(n), p.detach()) for n, p in policy.named_parameters())
        llm.reset_prefix_cache()
        self.room_for_kv_cache()
        if self.kv_asleep:
            self._wake(lambda: llm.wake_up(tags=["kv_cache"]), ["kv_cache"])
        try:
            with instead(llm, "generate", lambda *a, **kw: self._generate(generate, *a, **kw)):
                yield llm
        finally:
            self.sleep()

    def _wake(self, wake: Any, tags: list[str]) -> Any:
        """``wake()`` for ``tags``, the device bytes it took measured at driver level (what
        vLLM's pool maps), for the next turns' room.

        A wake that raises is put back to sleep (:func:`~tidal.integrations.vllm.pool.put_back_to_sleep`:
        what of it was mapped unmapped again), whatever it raised. Where it ran out of memory,
        every role that may go goes to the host (before the weights wake, of the policy only its
        optimizer state and gradients: its weights are their source), the cache goes back to the
        driver, and the engine wakes once more (counted in :attr:`oom_retries`); the later turns
        of those tags move the same out before their wakes (:attr:`out_first`), instead of
        keeping what the reading said fits and running out of memory again.

        Raises:
            InsufficientMemoryError: the wake ran out of memory again with those roles out (the
                engine asleep, the roles intact).
        """
        ops = self.timeshare.ops
        asleep = [t for t in tags if (self.asleep if t == "weights" else self.kv_asleep)]
        sleeping = asleep_allocations(asleep)
        backed_up = ("weights",) if self._slept_level == 1 else ()
        for retry in (False, True):
            before = ops.driver_free_bytes()[0]
            try:
                out = wake()
                break
            except BaseException as e:
                put_back_to_sleep(sleeping, backed_up=backed_up)
                if not is_out_of_memory(e):
                    raise
                if retry:
                    raise InsufficientMemoryError(
                        f"waking the engine's {' and '.join(asleep)}",
                        needed_bytes=allocation_bytes(sleeping),
                        free_bytes=ops.driver_free_bytes()[0],
                        hint="Every role that may leave was on the host; the engine sleeps again. Give the engine "
                        "a smaller KV cache (TidalConfig(vllm_kv_cache_bytes=...), vllm_gpu_memory_utilization) or "
                        "the device more room (another process's memory, prefetch_peak_bytes)",
                    ) from e
                self.oom_retries += 1
                self.out_first.update(asleep)
                self._all_out(asleep)
        taken = max(0, before - ops.driver_free_bytes()[0])
        if len(asleep) == 1:
            self.woken[asleep[0]] = taken
        if "weights" in tags:
            self.asleep = False
        if "kv_cache" in tags:
            self.kv_asleep = False
        return out

    def _generate(self, generate: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``generate(*args, **kwargs)``. One that raises leaves no request of its in the
        engine (vLLM keeps a failed generation's requests, and the next would return their
        outputs with its own), whatever it raised; one that ran out of memory runs again once
        every role not in use has left and the cache is the driver's, from the same random
        draws (counted in :attr:`oom_retries`): its tokens are those of a run that never kept
        the roles. A second failure goes on as it came."""
        draws = RandomState(self.timeshare.device)
        try:
            return generate(*args, **kwargs)
        except BaseException as e:
            abort_unfinished(self.llm)
            if not is_out_of_memory(e):
                raise
        self.oom_retries += 1
        self.out_first.add("kv_cache")
        self._all_out(["kv_cache"])
        draws.restore()
        try:
            return generate(*args, **kwargs)
        except BaseException:
            abort_unfinished(self.llm)
            raise

    def _all_out(self, tags: list[str]) -> None:
        """Before ``tags`` wake with nothing measured, or after their wake (or a generation)
        ran out of memory: every role not in use to the host (while the weights wake, of the
        policy only its optimizer state and gradients: its weights are pushed from it), the
        cache to the driver."""
        ts = self.timeshare
        for name in list(ts.resident_roles):
            if ts.role(name).in_use:
                continue
            if name == self.policy and "weights" in tags:
                self._record(ts.offload_optimizer_state(name, grads=True))
            else:
                self._record(ts.offload(name))
        self._release()

    def sleep(self) -> None:
        """The engine's memory back to the driver (``sleep_level``)."""
        self.llm.sleep(level=self.sleep_level)
        self.asleep = self.kv_asleep = True
        self._slept_level = self.sleep_level

    # ---- a trainer that drives the engine ------------------------------------------------------
    @contextlib.contextmanager
    def driven(self, *, before_generate: Callable[[], Any] | None = None) -> Iterator[None]:
        """For the block, the engine's ``wake_up``, ``generate`` and ``sleep`` (called by the
        trainer that owns the engine: TRL's) make the room first, as :meth:`generating` does:
        before the weights wake, :meth:`room_for_weights`; before the KV cache wakes (or, with
        sleep mode off, before a generation), :meth:`room_for_kv_cache`; then, the room made,
        ``before_generate()`` (a prefetch of the role that computes next, behind the
        generation). Attributes of the ``llm`` instance for the block
        (:func:`tidal.integrations.seams.instead`)."""
        llm = self.llm
        wake_up, generate, sleep = llm.wake_up, llm.generate, llm.sleep

        def wake(tags: list[str] | None = None, *args: Any, **kwargs: Any) -> Any:
            tags_ = list(tags) if tags else ["weights", "kv_cache"]
            if "weights" in tags_:
                self.room_for_weights()
            if "kv_cache" in tags_:
                self.room_for_kv_cache()
            return self._wake(lambda: wake_up(tags, *args, **kwargs), tags_)

        def gen(*args: Any, **kwargs: Any) -> Any:
            if not self._kv_room:
                self.room_for_kv_cache()  # awake all along (sleep mode off): the room made now
            if before_generate is not None:
                before_generate()
            return self._generate(generate, *args, **kwargs)

        def put_to_sleep(*args: Any, **kwargs: Any) -> Any:
            out = sleep(*args, **kwargs)
            self.asleep = self.kv_asleep = True
            self._slept_level = kwargs.get("level", args[0] if args else 1)  # vLLM's default level: 1
            return out

        self._kv_room = False  # a new turn: the roles may be back since the last
        with instead(llm, "wake_up", wake), instead(llm, "generate", gen), instead(llm, "sleep", put_to_sleep):
            yield
