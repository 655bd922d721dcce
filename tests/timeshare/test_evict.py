"""The eviction decision alone (tidal.timeshare.evict.choose_evictions): plain numbers, no
device, no store."""

from __future__ import annotations

from tidal.timeshare.evict import Resident, choose_evictions

MIB = 1 << 20


def _choose(incoming, others, **kw):
    args = dict(coming_bytes=sum(incoming.values()), free_bytes=0, bucket_bytes=0, budget_bytes=None)
    args.update(as_needed=True, room_asked=True)
    args.update(kw)
    return choose_evictions(incoming, others, **args)


def test_the_least_recently_used_go_first_and_only_as_many_as_the_room_takes():
    others = [
        Resident(name="new", entries={1: 4 * MIB}, last_used=3),
        Resident(name="old", entries={2: 4 * MIB}, last_used=1),
        Resident(name="mid", entries={3: 4 * MIB}, last_used=2),
    ]
    got = _choose({9: 6 * MIB}, others, free_bytes=MIB)  # 5 MiB short: two roles' worth
    assert got.evict == ["old", "mid"] and not got.short and got.busy == []
    assert _choose({9: 6 * MIB}, others, free_bytes=6 * MIB).evict == []  # it fits: nothing goes
    assert _choose({9: 6 * MIB}, others, free_bytes=3 * MIB).evict == ["old"]


def test_a_role_in_use_stays_unless_use_is_ignored_and_what_is_left_short_says_so():
    others = [Resident(name="busy", entries={1: 8 * MIB}, in_use=True, last_used=0)]
    got = _choose({9: 6 * MIB}, others)
    assert got.evict == [] and got.busy == ["busy"] and got.short
    got = _choose({9: 6 * MIB}, others, ignore_use=True)
    assert got.evict == ["busy"] and not got.short


def test_a_role_whose_storages_another_holds_goes_with_it_or_not_at_all():
    shared = {1: 8 * MIB}
    others = [
        Resident(name="rollout", entries=dict(shared), last_used=0),
        Resident(name="train", entries={**shared, 2: 2 * MIB}, last_used=1),
    ]
    # The rollout role alone frees nothing (train holds its weights): both go, together.
    got = _choose({9: 9 * MIB}, others, free_bytes=MIB)
    assert got.evict == ["rollout", "train"] and not got.short
    # With train in use the shared weights stay, so the rollout role does not go for nothing.
    busy = [others[0], Resident(name="train", entries=others[1].entries, in_use=True, last_used=1)]
    got = _choose({9: 9 * MIB}, busy, free_bytes=MIB)
    assert got.evict == [] and got.short and got.busy == ["train"]


def test_storages_already_on_the_host_free_nothing_when_their_role_goes():
    others = [
        Resident(name="half_out", entries={1: 4 * MIB, 2: 4 * MIB}, out=frozenset({2}), last_used=0),
        Resident(name="whole", entries={3: 4 * MIB}, last_used=1),
    ]
    got = _choose({9: 6 * MIB}, others, free_bytes=MIB)  # half_out frees 4 MiB, not 8
    assert got.evict == ["half_out", "whole"] and not got.short


def test_a_staging_bucket_in_and_one_out_are_counted():
    others = [Resident(name="a", entries={1: 4 * MIB}, last_used=0)]
    # 4 MiB in with 4 MiB free fits without buckets; with a 1 MiB bucket in it does not, and
    # moving a out (4 MiB, a bucket out too) makes the room.
    assert _choose({9: 4 * MIB}, others, free_bytes=4 * MIB).evict == []
    assert _choose({9: 4 * MIB}, others, free_bytes=4 * MIB, bucket_bytes=MIB).evict == ["a"]
    # 4 free + 4 freed - 2 buckets = 6 < 7: still short with a gone.
    got = _choose({9: 7 * MIB}, others, free_bytes=4 * MIB, bucket_bytes=MIB)
    assert got.evict == ["a"] and got.short


def test_a_budget_moves_out_until_what_stays_fits_it():
    others = [
        Resident(name="a", entries={1: 4 * MIB}, last_used=0),
        Resident(name="b", entries={2: 4 * MIB}, last_used=1),
    ]
    got = _choose({9: 4 * MIB}, others, budget_bytes=9 * MIB, as_needed=False)
    assert got.evict == ["a"] and not got.over_budget
    pinned = [Resident(name="a", entries={1: 4 * MIB}, in_use=True), others[1]]
    got = _choose({9: 4 * MIB}, pinned, budget_bytes=7 * MIB, as_needed=False)
    assert got.evict == ["b"] and got.over_budget and got.busy == ["a"]


def test_without_room_asked_nothing_goes():
    others = [Resident(name="a", entries={1: 4 * MIB})]
    assert _choose({9: 4 * MIB}, others, room_asked=False).evict == []
    assert _choose({9: 4 * MIB}, others, as_needed=False).evict == []  # no budget: the caller's case
