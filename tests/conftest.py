import gc
import sys

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _clean_device(request):
    # GPU tests measure driver-level memory: start and end each with the cache returned.
    if "gpu" not in request.keywords or not torch.cuda.is_available():
        yield
        return
    # pytest keeps the last failed test's traceback (sys.last_*) until the next test's call
    # starts, and with it that test's tensors; collected there, mid-test, they would hand this
    # test cached blocks the driver never sees. Drop it now.
    for name in ("last_exc", "last_type", "last_value", "last_traceback"):
        if hasattr(sys, name):
            delattr(sys, name)
    gc.collect()
    torch.cuda.empty_cache()
    yield
    gc.collect()
    torch.cuda.empty_cache()


def pytest_terminal_summary(terminalreporter):
    # How much the fault-injection sweeps covered (tests/faults.py), printed after the run.
    from tests.faults import SWEPT  # noqa: PLC0415

    if SWEPT:
        points = sum(p for _, p, _ in SWEPT)
        faults = sum(f for _, _, f in SWEPT)
        terminalreporter.write_line(
            f"fault sweep: {len(SWEPT)} sweeps, {points} instrumented points, "
            f"{faults} faults injected (KeyboardInterrupt and RuntimeError at each)"
        )
