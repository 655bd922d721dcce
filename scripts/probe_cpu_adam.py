"""Diagnostic: where does CPUAdam's in-backward step spend its time? Builds a Qwen2-shape
model, runs forward + `with opt.step_in_backward(): backward` + step with a trace, and prints
when gradients reach the host and when updates finish, relative to the end of backward.
Also times the fused kernel in the main thread and in a worker thread.
Usage: python scripts/probe_cpu_adam.py [preset] [batch] [seq]"""

import statistics
import sys
import threading
import time

import torch

import tidal
from tidal_recipes.cli.models import build_model


def kernel_rate(n: int) -> float:
    p, g, m, v = (torch.randn(n) for _ in range(4))
    s = torch.tensor(1.0)

    def run() -> float:
        t0 = time.perf_counter()
        torch._fused_adamw_(
            [p],
            [g],
            [m],
            [v],
            [],
            [s],
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            weight_decay=0.01,
            eps=1e-8,
            amsgrad=False,
            maximize=False,
        )
        return n / (time.perf_counter() - t0) / 1e9

    run()
    return statistics.median(run() for _ in range(5))


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "qwen2-1.5b"
    batch, seq = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (8, 2048)
    n = 100_000_000
    print(f"fused kernel, {n / 1e6:.0f} M params: main thread {kernel_rate(n):.2f} G/s", flush=True)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("g", kernel_rate(n)))
    t.start()
    t.join()
    print(f"fused kernel, worker thread {out['g']:.2f} G/s (torch threads {torch.get_num_threads()})", flush=True)

    model, desc = build_model(preset, device="cuda")
    opt = tidal.CPUAdam(model.parameters(), lr=1e-5)
    x = torch.randint(0, 1000, (batch, seq), device="cuda")
    for it in range(4):
        torch.cuda.synchronize()
        opt.trace = []
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        torch.cuda.synchronize()
        t_fwd = time.perf_counter()
        with opt.step_in_backward():
            loss.backward()
            torch.cuda.synchronize()
            t_bwd = time.perf_counter()
        t_ctx = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        t_end = time.perf_counter()
        tr = opt.trace
        opt.trace = None
        total = sum(n for e, _, n in tr if e == "updated")
        before = sum(n for e, t, n in tr if e == "updated" and t <= t_bwd)
        on_host_last = max(t for e, t, _ in tr if e == "on_host")
        upd_time = 0.0
        last_host = {}
        for e, t, n in tr:
            if e == "on_host":
                last_host[n] = t
            elif e == "updated":
                upd_time += t - last_host.get(n, t)
        print(
            f"iter {it}: fwd {t_fwd - t0:.3f}s bwd {t_bwd - t_fwd:.3f}s drain {t_ctx - t_bwd:.3f}s "
            f"step {t_end - t_ctx:.3f}s | total {t_end - t0:.3f}s | updated before bwd end "
            f"{before / max(total, 1):.0%} of {total / 1e9:.2f} G params | last grad on host "
            f"{on_host_last - t_bwd:+.3f}s vs bwd end | worker busy updating {upd_time:.3f}s",
            flush=True,
        )


if __name__ == "__main__":
    main()
