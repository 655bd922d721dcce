import json

import pytest

from tidal.device import DeviceOps
from tidal.timeline import MemoryTimeline


def test_phases_samples_marks_and_jsonl(tmp_path):
    level = {"bytes": 100}
    tl = MemoryTimeline(DeviceOps("cpu"), state_bytes=lambda: level["bytes"])
    with tl.phase("rollout", step=0):
        level["bytes"] = 300
        tl.sample()
        level["bytes"] = 50
    tl.mark("switch -> train", bytes=7)
    with tl.phase("train", step=0):
        tl.sample()
    assert [p.name for p in tl.phases] == ["rollout", "train"]
    assert tl.phases[0].peak_allocated_bytes == 300
    assert tl.phases[1].peak_allocated_bytes == 50
    assert tl.phases[0].end_s <= tl.phases[1].start_s
    with pytest.raises(RuntimeError, match="do not nest"):
        with tl.phase("a"):
            with tl.phase("b"):
                pass
    path = tmp_path / "t.jsonl"
    tl.write_jsonl(str(path), extra=[{"type": "summary", "x": 1}])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["type"] for r in rows].count("phase") == 3
    assert rows[-1] == {"type": "summary", "x": 1}
    assert any(r["type"] == "mark" and r["bytes"] == 7 for r in rows)


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    tl = MemoryTimeline(DeviceOps("cpu"), state_bytes=lambda: 1 << 20)
    for step in range(5):
        for name in ("rollout", "reference", "train"):
            with tl.phase(name, step=step):
                tl.sample()
    path = tmp_path / "t.png"
    tl.plot(str(path), rewards=[0.1, 0.2, 0.3, 0.4, 0.5])
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_plot_draws_other_runs_beside_it_on_one_scale(tmp_path, monkeypatch):
    """Issue 28: the demo's picture shows the all-resident loop beside the timeshare."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    runs = []
    for level in (1 << 20, 3 << 20):
        tl = MemoryTimeline(DeviceOps("cpu"), state_bytes=lambda level=level: level)
        for step in range(4):
            for name in ("rollout", "reference", "train"):
                with tl.phase(name, step=step):
                    tl.sample()
        runs.append(tl)
    seen = {}
    real = plt.Figure.savefig

    def keep(fig, path, *args, **kwargs):
        seen["axes"] = [(ax.get_title(), ax.get_ylim()) for ax in fig.axes]
        return real(fig, path, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", keep)
    runs[0].plot(str(tmp_path / "t.png"), title="timeshare", rewards=[0.1] * 4, beside=[("resident", runs[1])])
    titles = [t for t, _ in seen["axes"]]
    assert titles[:2] == ["timeshare", "resident"] and len(titles) == 3  # two memory panels, the reward
    assert seen["axes"][0][1] == seen["axes"][1][1] == (0, 3 * 1.25), "one memory scale for both runs"
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_a_run_that_ran_out_of_memory_is_drawn_to_its_failure_beside_the_device_s_memory(tmp_path, monkeypatch):
    """The demo's picture of a loop that does not fit: its memory up to the failure, the phase it
    failed in, and the device's memory as a line, on the scale of the run beside it."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    level = {"bytes": 1 << 20}
    failed = MemoryTimeline(DeviceOps("cpu"), state_bytes=lambda: level["bytes"])
    failed.capacity_bytes = 4 << 20
    with failed.phase("rollout", step=0):
        failed.sample()
    with pytest.raises(MemoryError):
        with failed.phase("train", step=0):
            level["bytes"] = 5 << 20
            failed.sample()
            raise MemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")
    failed.out_of_memory(MemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore"), need_bytes=123)
    assert failed.phases[-1].name == "train" and failed.phases[-1].error == "MemoryError"
    oom = failed.marks[-1]
    assert oom["kind"] == "oom" and oom["phase"] == "train" and oom["need_bytes"] == 123
    assert oom["error"] == "CUDA out of memory. Tried to allocate 2.00 GiB"
    ok = MemoryTimeline(DeviceOps("cpu"), state_bytes=lambda: 1 << 20)
    for step in range(2):
        for name in ("rollout", "train"):
            with ok.phase(name, step=step):
                ok.sample()
    seen = {}
    real = plt.Figure.savefig

    def keep(fig, path, *args, **kwargs):
        seen["axes"] = fig.axes
        return real(fig, path, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", keep)
    ok.plot(str(tmp_path / "t.png"), title="timeshare", beside=[("every role resident", failed)])
    ax = seen["axes"][1]
    labels = ax.get_legend_handles_labels()[1]
    assert "out of memory in train" in labels and "the device's memory" in labels
    assert seen["axes"][0].get_ylim() == ax.get_ylim() == (0, 5 * 1.25)
    cross = next(line for line in ax.get_lines() if line.get_label() == "out of memory in train")
    assert cross.get_ydata()[0] == 4  # at the device's memory, in MiB
