"""The study presets: the study's six factors on the data-bound task, a calibrated baseline,
repeats to measure spread, and a quick cut of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.calibration import settings
from experiments.spec import expand, load_spec

PRESETS = Path(__file__).resolve().parents[3] / "experiments" / "presets"
FACTORS = {"peers", "batch_size", "lr", "target_batch_size", "mode", "num_workers"}


@pytest.mark.parametrize("name", ["study", "study-quick"])
def test_study_presets_are_calibrated_repeated_and_data_bound(name: str):
    spec = load_spec(PRESETS / f"{name}.toml")
    assert spec.task.name == "images" and spec.calibration.enabled and spec.baseline
    assert len(spec.seeds) >= 2 and spec.stop.target_loss is not None
    assert all(len(values) >= 2 for values in spec.grid.values())
    assert set(spec.grid) == (FACTORS if name == "study" else {"num_workers", "mode"})
    configs = expand(spec)
    assert sum(c.baseline for c in configs) == len(spec.seeds)
    assert "params" in spec.grid["mode"] and 0 in spec.grid["num_workers"]
    roles = {role for role, _ in settings(spec)}
    assert roles == {"baseline", "peer"}


def test_the_quick_variant_fits_in_about_ten_minutes():
    spec = load_spec(PRESETS / "study-quick.toml")
    calibration_s = len(settings(spec)) * (spec.calibration.warmup_s + spec.calibration.measure_s)
    # training time alone, before process start-up (~10-20 s a configuration on 2 CPUs)
    training_s = len(expand(spec)) * spec.stop.max_time_s
    assert calibration_s + training_s <= 6 * 60
