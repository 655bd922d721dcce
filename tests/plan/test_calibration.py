"""GPU: predicted per-phase peaks vs measured (plain transformers + torch phases), within 10%.

See ``tests/plan/calibrate.py`` for what each phase runs; ``python -m tests.plan.calibrate``
prints the same comparison as a table.
"""

import pytest
import torch

from tidal.plan import PlanConfig

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("key", ["0.5b", "0.5b-ckpt", "1.5b"])
def test_predicted_phase_peaks_within_10_percent(key):
    pytest.importorskip("transformers")
    from tests.plan.calibrate import _COMMON, CONFIGS, compare, measure

    c = PlanConfig(**_COMMON, **CONFIGS[key])
    if torch.cuda.get_device_properties(0).total_memory < 40 << 30:
        pytest.skip("needs a GPU with 40 GiB")
    rows = compare(c, measure(c))
    assert {r[0] for r in rows} == {"rollout", "reference", "train", "optimizer_step"}
    bad = [r for r in rows if not 0.9 <= r[3] <= 1.1]
    assert not bad, bad
