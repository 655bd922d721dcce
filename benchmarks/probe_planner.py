"""Where the activation planner's predicted peak and the measured one part (a GPU probe).

    python benchmarks/probe_planner.py [--config qwen2-1.5b-16L] [--budget-gib 43.33]

Runs the planner's measured reference step, then the plan it makes, then the plan the model
without per-layer peaks would have made (explicit plan), each with the allocator's peak taken
per stretch (every layer's forward and backward, the head), and prints per layer: mode, saved
and input bytes, the bytes allocated when the stretch started and its peak, so the stretch
holding each step's peak, and its size against the prediction, can be read off.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import tidal.activations.offload as offload_mod  # noqa: E402
from bench_activations import CONFIGS, build  # noqa: E402
from tidal.activations import ActivationOffloadConfig, ActivationOffloader  # noqa: E402
from tidal.activations.planner import plan_from_report  # noqa: E402
from tidal.activations.step import PeakWindows  # noqa: E402

GiB = 2**30


class Recording(PeakWindows):
    def __init__(self, ops):
        super().__init__(ops)
        self.starts: dict = {}

    def open(self, key):
        super().open(key)
        self.starts[key] = self._open[1]


def step(model, ids, off):
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with off:
            loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.cuda.synchronize()
    del loss
    return off._step


def show(title, st, modes, n, predicted=None):
    w = st.windows
    print(
        f"{title}: step peak {w.step_peak / GiB:.2f} GiB" + (f", predicted {predicted / GiB:.2f}" if predicted else "")
    )
    best = max(w.excess, key=lambda k: w.starts.get(k, 0) + w.excess[k])
    for phase in ("forward", "backward"):
        for i in range(n):
            k = (phase, i)
            if k in w.excess:
                s, e = w.starts.get(k, 0), w.excess[k]
                mark = "  <- peak" if k == best else ""
                print(
                    f"  {phase:<8} {i:2d} {modes[i].value:<18} start {s / GiB:6.2f} +{e / GiB:5.2f} = {(s + e) / GiB:6.2f}{mark}"
                )
    for name, k in (("head fwd", ("after", n - 1)), ("head bwd", ("head_backward", 0))):
        if k in w.excess:
            s, e = w.starts[k], w.excess[k]
            mark = "  <- peak" if k == best else ""
            print(f"  {name}    start {s / GiB:6.2f} +{e / GiB:5.2f} = {(s + e) / GiB:6.2f}{mark}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="qwen2-1.5b-16L")
    ap.add_argument("--budget-gib", type=float, default=43.33)
    args = ap.parse_args()
    torch.manual_seed(0)
    *_, batch, seq = CONFIGS[args.config]
    model = build(args.config)
    layers = model.model.layers
    n = len(layers)
    ids = torch.randint(0, 151936, (batch, seq), device="cuda")
    offload_mod.PeakWindows = Recording
    budget = int(args.budget_gib * GiB)
    off = ActivationOffloader(model, layers=layers, config=ActivationOffloadConfig(budget_bytes=budget))
    ref = step(model, ids, off)
    rep = off.report()
    print(
        f"budget {budget / GiB:.2f} GiB; static {rep.start_allocated_bytes / GiB:.2f} GiB; head forward peak {rep.head_forward_peak_bytes / GiB:.2f} GiB, head backward peak {rep.head_backward_peak_allocated_bytes / GiB:.2f} GiB (allocated)"
    )
    for i in range(n):
        print(
            f"  layer {i:2d} saved {rep.group_saved_bytes[i] / GiB:5.2f} input {rep.group_input_bytes[i] / GiB:5.2f} "
            f"fwd peak {rep.layer_forward_peak_bytes[i] / GiB:5.2f} bwd peak {rep.layer_backward_peak_bytes[i] / GiB:5.2f}"
        )
    show("reference", ref, rep.modes, n)
    off._is_planner_reference = lambda: True  # record the stretches of the planned steps too
    step(model, ids, off)  # the plan is made on entry; this step warms up
    st = step(model, ids, off)
    plan = off.plan
    print(plan.summary())
    show("plan", st, plan.modes, n, plan.predicted_peak_bytes)
    # The plan the model without per-layer peaks (and its head fit) makes from the same step.
    blind = plan_from_report(
        off,
        dataclasses.replace(
            rep,
            layer_forward_peak_bytes=None,
            layer_backward_peak_bytes=None,
            head_forward_peak_bytes=None,
            head_backward_peak_allocated_bytes=None,
        ),
    )
    print("without per-layer peaks:", blind.summary())
    off.close()
    old = ActivationOffloader(model, layers=layers, plan=list(blind.modes))
    old._is_planner_reference = lambda: True
    step(model, ids, old)
    st = step(model, ids, old)
    show("plan without per-layer peaks", st, blind.modes, n, blind.predicted_peak_bytes)
    old.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
