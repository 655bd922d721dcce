"""The host-stack sampler of bench_trl.py (benchmarks/host_samples.py) finds where a verb's host
time goes."""

import os
import sys
import time

import torch

import tidal

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from host_samples import StackSampler  # noqa: E402


def test_the_sampler_charges_a_slow_call_inside_a_verb_to_that_verb_and_that_call():
    model = torch.nn.Linear(256, 256)
    ts = tidal.Timeshare("cpu")
    ts.add_role("a", model=model)
    ts.offload("a")
    real = ts.store.switch

    def slow_switch(*args, **kwargs):  # the call the host blocks in: 60 ms
        time.sleep(0.06)
        return real(*args, **kwargs)

    ts.store.switch = slow_switch
    sampler = StackSampler(interval_s=0.001)
    sampler.start()
    try:
        time.sleep(0.03)  # outside any verb: not counted
        ts.load("a")
    finally:
        sampler.stop()
        ts.store.switch = real
    per_verb = sampler.by_verb()
    assert set(per_verb) == {"load"}, per_verb
    assert 0.03 <= per_verb["load"] <= 0.2, per_verb
    heaviest = sampler.top(1)[0]
    assert heaviest["frame"].endswith("slow_switch") and heaviest["verb"] == "load", heaviest
    assert heaviest["tidal_frame"].startswith("tidal/timeshare/"), heaviest
    ts.close()


def test_a_checkout_named_tidal_does_not_make_its_other_files_tidal_frames():
    """Found running the tests from a clone in a directory named tidal: the test file's own frame
    counted as tidal's, since its path has a "/tidal/" in it."""
    import os

    import host_samples

    package = os.path.dirname(tidal.__file__)
    assert host_samples._in_package(os.path.join(package, "timeshare", "timeshare.py")) == os.path.join(
        "tidal", "timeshare", "timeshare.py"
    )
    checkout = os.path.dirname(package)
    assert host_samples._in_package(os.path.join(checkout, "tidal_like", "x.py")) is None
    assert host_samples._in_package(os.path.join("/elsewhere", "tidal", "tests", "test_x.py")) is None
