"""The phase clock of bench_trl.py (benchmarks/phase_clock.py): each phase's time, a phase
called inside another counted for the outer one only."""

import os
import sys
import time


sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from phase_clock import PhaseClock  # noqa: E402


class Trainer:
    def inner(self, model):
        time.sleep(0.02)

    def outer(self):
        time.sleep(0.03)
        self.inner("policy")  # counted inside outer, not on its own


def test_each_call_counts_once_under_its_outermost_phase():
    t = Trainer()
    clock = PhaseClock(cuda=False)
    clock.wrap(t, "inner", lambda model: f"logps:{model}")
    clock.wrap(t, "outer", "loss")
    clock.wrap(t, "outer", "again")  # wrapping twice keeps the first
    t.outer()
    t.inner("ref")
    t.inner("ref")
    got = clock.take()
    assert set(got) == {"loss", "logps:ref"}, got
    assert 0.05 <= got["loss"] < 0.2 and 0.04 <= got["logps:ref"] < 0.2, got
    assert clock.take() == {}  # taken: the next step starts empty


def test_token_gaps_show_the_one_token_that_waited_and_only_inside_generation():
    import types

    import torch

    from phase_clock import TokenGaps

    class Trainer:
        def __init__(self):
            self.model = torch.nn.Linear(2, 2)
            self.accelerator = types.SimpleNamespace(unwrap_model=lambda m: m)

        def _generate(self, slow_at: int):
            x = torch.zeros(1, 2)
            for i in range(8):  # a prefill and 7 tokens, one of which waits
                time.sleep(0.2 if i == slow_at else 0.01)
                self.model(x)

    tr = Trainer()
    gaps = TokenGaps()
    gaps.wrap_trainer(tr)
    tr.model(torch.zeros(1, 2))  # outside generation: not a token
    tr._generate(slow_at=4)
    got = gaps.take()
    assert got["count"] == 7
    assert 0.19 <= got["longest"] < 0.4 and 0.009 <= got["median"] < 0.05
    assert 0.1 < got["excess"] < 0.4
    assert gaps.take() is None  # taken: nothing since


def test_token_gaps_split_a_token_into_the_forward_and_what_follows_it():
    import types

    import torch

    from phase_clock import TokenGaps

    class Slow(torch.nn.Module):
        def forward(self, x):
            time.sleep(0.05)  # the host queueing the forward's kernels
            return x

    class Trainer:
        def __init__(self):
            self.model = Slow()
            self.accelerator = types.SimpleNamespace(unwrap_model=lambda m: m)

        def _generate(self):
            for _ in range(5):
                self.model(torch.zeros(1))
                time.sleep(0.01)  # sampling, the read of whether every sequence finished

    tr = Trainer()
    gaps = TokenGaps()
    gaps.wrap_trainer(tr)
    tr._generate()
    tr._generate()  # two calls: no gap counted across them
    got = gaps.take()
    assert got["count"] == 8
    assert 0.049 <= got["launch"] < 0.08, got
    assert 0.059 <= got["median"] < 0.1 and got["median"] - got["launch"] >= 0.009, got
    assert 0.47 <= got["total"] < 0.8, got
    assert "device" not in got  # no timing events without CUDA


def test_the_host_probe_is_read_around_each_generation_and_reported_beside_its_tokens():
    import types

    import torch

    from phase_clock import HostProbe, TokenGaps

    real = HostProbe("cpu", ops=50, rounds=3)
    first = real.read()
    assert 0 < first < 0.01  # seconds an op: microseconds on any host

    class Probe:
        readings = iter([1.0, 3.0, 5.0, 9.0])

        def read(self):
            return next(self.readings)

    class Trainer:
        def __init__(self):
            self.model = torch.nn.Linear(2, 2)
            self.accelerator = types.SimpleNamespace(unwrap_model=lambda m: m)

        def _generate(self):
            for _ in range(3):
                self.model(torch.zeros(1, 2))

    tr = Trainer()
    gaps = TokenGaps(probe=Probe())
    gaps.wrap_trainer(tr)
    tr._generate()  # read 1 before, 3 after: 2
    tr._generate()  # 5, 9: 7
    got = gaps.take()
    assert got["probe"] == 4.5  # the median of the calls' means
    assert TokenGaps().take() is None
