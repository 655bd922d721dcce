"""The phase schedule (tidal.timeshare.schedule) and its memory readings
(tidal.timeshare.phase_memory), device-free: a fake allocator and a fake timeshare, with TRL's
phases (the adapter's ``TRL_PHASES``) as the step."""

from __future__ import annotations

import types

import pytest

from tests.helpers import FakeAllocator
from tidal.memory import phase_need_bytes
from tidal.timeshare.phase_memory import PhaseMemory
from tidal.timeshare.schedule import PhaseSchedule, ScheduleConfig, StepPhases

TRL_PHASES = StepPhases(order=("policy", "reference", "reward"), turn_phase={"policy": "loss"})


class _PolicyResident:
    """What a schedule reads of a timeshare whose policy is on the device and whose reference
    (``reference_bytes``) is out; the prefetches it is asked for are put in ``asked``."""

    roles = {"policy": None, "reference": None}
    ops = types.SimpleNamespace(fragmented_free_bytes=lambda: 0)

    def __init__(self, asked: list, *, reference_bytes: int) -> None:
        self.asked, self.reference_bytes = asked, reference_bytes

    def is_resident(self, role):
        return role == "policy"

    def bytes_to_load(self, role):
        return 0 if self.is_resident(role) else self.reference_bytes

    def role(self, name):
        return types.SimpleNamespace(optimizer_residency="role")

    def prefetch(self, role, **kw):
        self.asked.append({"role": role, **kw})


def test_a_log_line_inside_a_phase_does_not_reset_what_the_phase_allocated():
    """Issue 26: TRL logs after the optimizer step, inside the backward phase (which holds the
    step). The log's reading restarted the phase, so the next step's optimizer-state prefetch
    saw a backward that allocated nothing, left nothing free and brought in past
    prefetch_peak_bytes (22.06 GiB measured against a 17 GiB bound on an H100)."""

    gib = 1 << 30
    dev = FakeAllocator()
    memory = PhaseMemory(lambda: dev.now, lambda: dev.high, dev.reset)
    dev.set(6 * gib)
    memory.start("generate")
    dev.set(10 * gib)
    dev.set(6 * gib)
    memory.start("loss")
    dev.set(13 * gib)  # the forward's activations
    memory.start("backward")
    memory.prefetched(1 * gib)  # optimizer state brought in ahead of the step
    dev.set(17 * gib)  # + gradients and the streamed step's chunks, less the activations
    dev.set(12 * gib)
    peaks = memory.take_peaks()  # TRL's log line, after the step
    assert peaks == {"generate": 10 * gib, "loss": 13 * gib, "backward": 17 * gib}
    dev.set(6 * gib)  # gradients zeroed
    memory.start("generate")  # the next step
    assert memory.growth == {"generate": 4 * gib, "loss": 7 * gib, "backward": 3 * gib}
    # The next log line: only what came since the last (the backward's tail after the step).
    assert memory.take_peaks() == {"backward": 12 * gib, "generate": 6 * gib}


def test_a_phase_run_again_after_out_of_memory_keeps_its_whole_need():
    """A generation runs out of memory beside a prefetch (2026-11-28: a 32B shape's second step
    on 4 H100s, the policy gathered whole before its first forward); the prefetched role goes
    and the generation runs again. Counted from what the eviction left, the gathered copy (in
    place before the part that ran again) must stay in the phase's growth, and the prefetch's
    bytes, gone with the eviction, must not be taken off it: the next step's prefetch would
    otherwise leave free only the KV cache's part, and run out of memory again."""

    gib = 1 << 30
    dev = FakeAllocator()
    memory = PhaseMemory(lambda: dev.now, lambda: dev.high, dev.reset)
    dev.set(15 * gib)  # the policy's shards
    memory.start("generate")
    memory.rebase()  # its turn's switch ran
    dev.set(61 * gib)  # gathered whole, its shards lent
    gathered = memory.grown()
    memory.prefetched(9 * gib)  # the reference, behind it
    dev.set(70 * gib)
    dev.set(72 * gib)  # the KV cache, then out of memory
    dev.set(61 * gib)  # the failed run's cache freed, the prefetched reference moved out
    memory.rebase(grown_bytes=gathered)
    dev.set(66 * gib)  # the generation again: its KV cache
    dev.set(15 * gib)
    memory.start("reference")
    assert memory.growth["generate"] == 51 * gib  # the gathered copy's 46 and the cache's 5


def test_a_prefetch_started_inside_its_phase_leaves_free_only_what_the_phase_has_still_to_allocate():
    """Generation of an FSDP2 policy gathers it whole before its first forward, where the
    reference's prefetch starts: the gathered copy is part of the generation's growth, but
    already allocated then. Left free a second time, it kept the reference out of a 14B
    generation on 2 H100s with 33 GiB free (2026-11-27). The prefetch leaves the rest of the
    phase's growth (its KV cache), +10% and 256 MiB; but all of it where the last generation
    gathered per unit (its growth did not hold the whole policy: the cache is still to come)."""

    gib = 1 << 30
    dev = FakeAllocator()
    memory = PhaseMemory(lambda: dev.now, lambda: dev.high, dev.reset)
    asked: list[dict] = []
    ts = _PolicyResident(asked, reference_bytes=14 * gib)
    schedule = PhaseSchedule(ts, TRL_PHASES, config=ScheduleConfig(prefetch=True), memory=memory)
    schedule.depth = 1
    dev.set(14 * gib)  # the policy's shards

    def generation(gathered: bool):
        schedule.gathered(27 * gib if gathered else 0)
        memory.start("generate")
        memory.rebase()  # its turn's switch ran
        dev.set(41 * gib if gathered else 15 * gib)  # the whole policy gathered, or one unit
        schedule.prefetch("generate", "reference")  # at the first forward
        dev.set(dev.now + 2 * gib)  # the KV cache
        dev.set(14 * gib)  # resharded, the cache freed
        memory.start("reference")

    generation(gathered=True)
    assert asked == []  # the first generation's growth was not known yet
    generation(gathered=True)
    assert memory.growth["generate"] == 29 * gib
    assert asked[-1]["role"] == "reference" and asked[-1]["leave_free_bytes"] == phase_need_bytes(2 * gib)
    generation(gathered=False)  # per unit this time: nothing up front
    assert asked[-1]["leave_free_bytes"] == phase_need_bytes(29 * gib)
    generation(gathered=True)  # gathered after a generation that was not: its whole growth left
    assert asked[-1]["leave_free_bytes"] == phase_need_bytes(3 * gib)
    # Not inside its phase (a caller naming another), the whole growth is left, as before.
    schedule.prefetch("generate", "reference")
    assert asked[-1]["leave_free_bytes"] == phase_need_bytes(29 * gib)
    # The most the allocator's fragments reached in the last generation (pieces its KV cache's
    # blocks could not use) is left too; not those there now (the backward's, which the
    # prefetched role's small blocks can use).
    memory.fragments["generate"] = 1 * gib
    ts.ops = types.SimpleNamespace(fragmented_free_bytes=lambda: 3 * gib)
    generation(gathered=True)
    assert asked[-1]["leave_free_bytes"] == phase_need_bytes(2 * gib) + 1 * gib


def test_the_allocators_fragments_are_left_free_but_do_not_take_from_the_bound_on_allocated_bytes():
    """``prefetch_peak_bytes`` bounds the device's allocated bytes. The allocator's fragments
    are free memory a large block cannot use: each prefetch and keep leaves them free beside
    the phase's need, but they are not allocated, so they do not take from the bound. Counted
    there, the ~6 GiB of them a 1.5B step's backward leaves (and the next generation's
    reading then holds) cut the reference's prefetch behind generation by as much under a
    17 GiB bound: its scoring waited on the rest every step after the first. Nor does what a
    prefetch brought in count twice (allocated, and again as still to come)."""

    gib = 1 << 30
    dev = FakeAllocator()
    memory = PhaseMemory(lambda: dev.now, lambda: dev.high, dev.reset)
    asked: list[dict] = []

    class Timeshare:
        roles = {"policy": None, "reference": None}
        ops = types.SimpleNamespace(fragmented_free_bytes=lambda: 6 * gib)  # the backward's
        resident = {"policy"}
        arrived = 0

        def is_resident(self, role):
            return role in self.resident

        def bytes_to_load(self, role):  # a 7 GiB reference, less what arrived ahead
            return 0 if self.is_resident(role) else 7 * gib - self.arrived

        def role(self, name):
            return types.SimpleNamespace(optimizer_residency="step")

        def prefetch(self, role, **kw):
            asked.append({"role": role, **kw})

        def prefetch_optimizer(self, role, **kw):
            asked.append({"role": "optimizer", **kw})

    bound = 17 * gib

    schedule = PhaseSchedule(
        Timeshare(), TRL_PHASES, config=ScheduleConfig(prefetch=True, prefetch_peak_bytes=bound), memory=memory
    )
    schedule.depth = 1
    memory.growth.update(generate=4 * gib, reference=2 * gib, loss=1 * gib, backward=1 * gib)
    memory.fragments.update(generate=6 * gib, loss=5 * gib, backward=6 * gib)
    dev.set(7 * gib)  # the policy
    memory.start("generate")
    memory.rebase()
    schedule.prefetch("generate", "reference")
    need = phase_need_bytes(4 * gib)
    assert asked[-1]["role"] == "reference" and asked[-1]["leave_free_bytes"] == need + 6 * gib
    assert asked[-1]["limit_bytes"] == bound - 7 * gib - need  # 5.3 GiB of the reference; with the fragments: none
    # The reference's turn, 5 GiB of it prefetched: the policy stays beside it where the rest
    # and the scoring's need fit under the bound (7 + 5 + 2 + 2.45 GiB); what arrived ahead is
    # counted once (twice, 21.45 GiB: the policy would go, to come back for the loss).
    Timeshare.arrived = 5 * gib
    dev.set(12 * gib)
    schedule.depth = 0
    assert schedule.keep_free("reference", "reference") == phase_need_bytes(2 * gib)
    schedule.depth = 1
    dev.set(12 * gib)  # the loss's activations as its backward starts
    schedule.prefetch_optimizer("backward", "policy", growth=2 * gib)
    need = phase_need_bytes(2 * gib)
    assert asked[-1]["role"] == "optimizer" and asked[-1]["leave_free_bytes"] == need + 6 * gib
    assert asked[-1]["limit_bytes"] == bound - 12 * gib - need
    # The loss's turn keeps the reference where its need and the backward's fit under the bound
    # beside what is allocated (7 + 7 + 2.45 GiB; with the fragments 22.45: none), and keeps the
    # fragments free beside them.
    Timeshare.resident = {"policy", "reference"}
    dev.set(14 * gib)
    need = phase_need_bytes(2 * gib)
    schedule.depth = 0
    assert schedule.keep_free("reference", "loss") == need + 6 * gib
    dev.set(bound - need + 1)
    assert schedule.keep_free("reference", "loss") is None  # no room under the bound


@pytest.mark.parametrize("residency", ["step", "stream"])
def test_under_the_bound_the_loss_keeps_no_role_beside_optimizer_state_the_step_brings_in_anyway(residency):
    """With ``"step"`` residency the optimizer step brings all of the state in, whatever came in
    ahead behind the backward; the backward's growth leaves out what that prefetch brought in.
    Under ``prefetch_peak_bytes`` the loss's keep counts it: a reference kept on the growth
    alone would put the step over the bound (3 GiB policy and reference, 3 GiB gradients, 6 GiB
    of AdamW state all prefetched last time: 7 + 3 + 6 = 16 GiB against 15). Streamed, the
    prefetch brings in only what the bound leaves beside the kept roles: the keep stands."""

    gib = 1 << 30
    dev = FakeAllocator()
    memory = PhaseMemory(lambda: dev.now, lambda: dev.high, dev.reset)

    class Timeshare:
        roles = {"policy": None, "reference": None}
        ops = types.SimpleNamespace(fragmented_free_bytes=lambda: 0)

        def is_resident(self, role):
            return True

        def bytes_to_load(self, role):
            return 0

        def role(self, name):
            return types.SimpleNamespace(optimizer_residency=residency)

    schedule = PhaseSchedule(
        Timeshare(), TRL_PHASES, config=ScheduleConfig(prefetch=True, prefetch_peak_bytes=15 * gib), memory=memory
    )

    # The last step: the loss's forward 1 GiB, the backward 3 GiB of gradients, then the step
    # with all 6 GiB of state, which the backward's prefetch had brought in.
    dev.set(3 * gib)
    memory.start("loss")
    dev.set(4 * gib)
    memory.start("backward")
    memory.prefetched(6 * gib)
    dev.set(4 * gib + 6 * gib + 3 * gib)
    dev.set(3 * gib)
    memory.start("generate")
    assert memory.growth["backward"] == 3 * gib and memory.brought_in["backward"] == 6 * gib
    dev.set(6 * gib)  # the policy and the reference, as the loss's turn begins
    keep = schedule.keep_free("reference", "loss")
    if residency == "step":
        assert keep is None  # 6 + 4.65 + 6 > 15: the reference goes
    else:
        assert keep == phase_need_bytes(4 * gib)  # 6 + 4.65 <= 15


def test_a_phases_need_is_counted_from_what_its_switch_left():
    """Run i5 (7B, 64 x 256, H100): the loss's turn dropped the reference (14 GiB) and the
    forward's activations filled that room, so read from before the switch the loss allocated
    nothing; the next step's loss then kept the reference beside a backward it had no room for,
    and ran out of memory. Read from after the switch (rebase), the activations count."""

    gib = 1 << 30
    dev = FakeAllocator()
    memory = PhaseMemory(lambda: dev.now, lambda: dev.high, dev.reset)
    dev.set(57 * gib)  # policy, its AdamW state and the reference after the scoring
    memory.start("loss")
    dev.set(43 * gib)  # the loss's switch drops the reference
    memory.rebase()
    dev.set(52 * gib)  # the forward's activations
    memory.start("backward")
    dev.set(61 * gib)  # + gradients, less activations
    dev.set(43 * gib)
    memory.start("generate")
    assert memory.growth["loss"] == 9 * gib and memory.growth["backward"] == 9 * gib
    assert memory.take_peaks()["loss"] == 57 * gib  # the switch's peak stays the phase's, for the log


def test_the_backwards_need_grows_with_what_the_loss_holds_as_it_starts():
    """The backward's room (its second reading, and the optimizer state brought in behind it)
    comes from the last step's backward. A batch of longer completions holds more activations
    as the backward starts, and its backward allocates more (the activations' gradients): the
    last reading is scaled up by how much more the loss's forward holds, never down."""

    gib = 1 << 30
    dev = FakeAllocator()
    memory = PhaseMemory(lambda: dev.now, lambda: dev.high, dev.reset)

    def step(held: int, backward: int) -> int | None:
        dev.set(43 * gib)
        memory.start("loss")
        memory.rebase()
        dev.set(43 * gib + held)  # the forward's activations
        need = memory.backward_need()
        memory.start("backward")
        dev.set(43 * gib + held + backward)
        dev.set(43 * gib)
        memory.start("generate")
        return need

    assert step(8 * gib, 6 * gib) is None  # not measured yet
    assert step(8 * gib, 6 * gib) == 6 * gib  # the same batch: the same need
    assert step(16 * gib, 12 * gib) == 12 * gib  # twice the activations: twice the last need
    assert step(4 * gib, 3 * gib) == 12 * gib  # a shorter batch: the last need, not scaled down
    assert step(4 * gib, 3 * gib) == 3 * gib


def _bare_timeshare():
    import torch

    import tidal

    policy, reference = torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)
    ts = tidal.Timeshare(device="cpu")
    ts.add_role("policy", model=policy, optimizer=torch.optim.AdamW(policy.parameters()))
    ts.add_role("reference", model=reference, frozen=True)
    return ts, policy, reference


@pytest.mark.parametrize("keep", [None, 1 << 20])
def test_a_bare_loop_takes_turns_through_the_schedule_and_keeps_what_it_is_told_off_an_accelerator(keep):
    """On the CPU nothing is measured: each turn keeps ``unmeasured_keep_free_bytes`` free (None:
    every other role goes, the timeshare's plain switch), and the reference comes in behind the
    generation, so its turn copies nothing. Phases nest: an inner one makes no new room."""
    import torch

    ts, policy, reference = _bare_timeshare()
    schedule = PhaseSchedule(
        ts, TRL_PHASES, config=ScheduleConfig(prefetch=True, unmeasured_keep_free_bytes=keep), memory=None
    )
    ts.offload("reference")  # the policy generates first
    with schedule.phase("policy", "generate"):
        assert schedule.depth == 1 and ts.is_resident("policy")
        rec = schedule.prefetch("generate", schedule.after("policy"))
        assert rec is not None and rec.bytes_in > 0
        with schedule.phase("policy", "score"):
            assert schedule.depth == 2
        policy(torch.randn(2, 256))
    with schedule.phase("reference", "reference"):
        reference(torch.randn(2, 256))
    switch = ts.records[-1]
    assert switch.role_in == "reference" and switch.bytes_in == 0  # arrived ahead
    assert ts.is_resident("policy") == (keep is not None)  # kept beside it only where told to
    assert schedule.depth == 0
    ts.close()


def test_a_phase_that_raises_leaves_the_schedule_closed_and_its_role_restorable():
    ts, policy, reference = _bare_timeshare()
    before = {k: v.clone() for k, v in reference.state_dict().items()}
    schedule = PhaseSchedule(ts, TRL_PHASES, memory=None)
    for exc in (RuntimeError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with schedule.phase("reference", "reference"):
                raise exc
        assert schedule.depth == 0
    with schedule.phase("reference", "reference"):
        assert all((reference.state_dict()[k] == v).all() for k, v in before.items())
    ts.close()


def test_after_reads_the_order_as_a_cycle_skipping_roles_not_registered():
    ts, _, _ = _bare_timeshare()
    schedule = PhaseSchedule(ts, TRL_PHASES, memory=None)
    assert schedule.after("policy") == "reference"
    assert schedule.after("reference") == "policy"  # no reward model: back to the policy
    with pytest.raises(ValueError, match="not a role of this step's order"):
        schedule.after("critic")
    ts.close()


def test_without_prefetch_nothing_is_kept_nor_brought_in_ahead():
    ts, _, _ = _bare_timeshare()
    schedule = PhaseSchedule(ts, TRL_PHASES, config=ScheduleConfig(prefetch=False), memory=None)
    assert schedule.keep_free("policy", "loss") is None
    with schedule.phase("policy", "generate"):
        assert schedule.prefetch("generate", "reference") is None
    assert schedule.prefetch_optimizer("backward", "policy") is None
    ts.close()


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: StepPhases(order=()), ValueError, "must name each role once"),
        (lambda: StepPhases(order=("a", "a")), ValueError, "must name each role once"),
        (lambda: StepPhases(order=("a",), turn_phase={"b": "x"}), ValueError, "names roles not in order"),
        (lambda: ScheduleConfig(prefetch="no"), TypeError, "prefetch must be a bool"),
        (lambda: ScheduleConfig(prefetch_peak_bytes=-1), ValueError, "prefetch_peak_bytes must be an int >= 0"),
        (lambda: ScheduleConfig(unmeasured_keep_free_bytes=1.5), ValueError, "must be an int >= 0"),
        (lambda: PhaseSchedule(None, ("policy",)), TypeError, "phases must be a tidal.timeshare.StepPhases"),
        (lambda: PhaseSchedule(None, TRL_PHASES, config={}), TypeError, "config must be"),
    ],
)
def test_bad_settings_are_refused_when_made(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_bytes_the_allocator_counts_off_the_device_do_not_take_from_the_bound():
    """An inference engine's pool stays counted as allocated by torch while it sleeps, its
    memory back with the driver: ``outside_bytes`` leaves it out of what ``prefetch_peak_bytes``
    is compared with, so the loss's keep and a prefetch behind a phase see the device's own."""
    gib = 1 << 30
    dev = FakeAllocator()
    memory = PhaseMemory(lambda: dev.now, lambda: dev.high, dev.reset)
    asked: list[dict] = []
    bound = 20 * gib
    ts = _PolicyResident(asked, reference_bytes=7 * gib)
    schedule = PhaseSchedule(
        ts, TRL_PHASES, config=ScheduleConfig(prefetch=True, prefetch_peak_bytes=bound), memory=memory
    )
    memory.growth.update(generate=1 * gib, reference=1 * gib)
    dev.set(7 * gib + 10 * gib)  # the policy, and a sleeping engine's 10 GiB still counted
    memory.start("reference")
    assert schedule.keep_free("reference", "reference") is None  # 17 + 7 + 1.35 GiB: over the bound
    schedule.outside_bytes = lambda: 10 * gib
    assert schedule.keep_free("reference", "reference") == phase_need_bytes(1 * gib)  # 7 + 7 + 1.35 GiB
    schedule.prefetch("reference", "reference", growth=1 * gib)
    assert asked[-1]["limit_bytes"] == bound - 7 * gib - phase_need_bytes(1 * gib)
