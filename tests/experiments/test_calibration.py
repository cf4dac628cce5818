"""Calibration: every setting is measured by a real process, the fastest is what the baseline
and the peers run with, and the results are reused for the same spec only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.calibration import (
    CALIBRATION_FILE,
    Calibration,
    Setting,
    Trial,
    apply,
    calibrate,
    calibration_key,
    settings,
    settings_table,
)
from experiments.runner import baseline_plan, peer_plans
from experiments.spec import expand, parse_spec

pytestmark = pytest.mark.timeout(240)


def spec_data(**calibration) -> dict:
    return {
        "name": "cal",
        "seeds": [0],
        "task": {"name": "synthetic", "options": {"hidden_dim": 32, "input_dim": 64}},
        "train": {"peers": 2, "batch_size": 32, "target_batch_size": 128},
        "grid": {"num_workers": [0, 1]},
        "resources": {"total_cpus": 2, "pin_cpus": False},
        "calibration": {"enabled": True, "measure_s": 1.0, "warmup_s": 0.3, **calibration},
        "stop": {"max_time_s": 5},
    }


def test_the_settings_cover_threads_policies_and_the_peers_workers():
    spec = parse_spec(spec_data())
    tried = settings(spec)
    baseline = {(s.torch_threads, s.wait_policy, s.num_workers) for r, s in tried if r != "peer"}
    assert baseline == {(t, p, 0) for t in (1, 2) for p in ("PASSIVE", "ACTIVE")}
    peers = {(s.cpus, s.torch_threads, s.wait_policy, s.num_workers) for r, s in tried}
    peers -= {(2, *b) for b in baseline}
    assert peers == {(1, 1, p, w) for p in ("PASSIVE", "ACTIVE") for w in (0, 1)}


def test_the_fastest_measured_setting_runs_and_is_reused(tmp_path: Path):
    spec = parse_spec(spec_data(wait_policies=["PASSIVE"]))
    calibration = calibrate(spec, tmp_path)
    assert len(calibration.trials) == 4
    assert all(t.samples_per_s and t.samples_per_s > 0 for t in calibration.trials), [
        t.error for t in calibration.trials
    ]
    # The reference: the chosen trial per role (and peer workers), read back from the file
    stored = json.loads((tmp_path / CALIBRATION_FILE).read_text())
    # (the fastest, or within 10% of it the fewest threads: all passive here)
    baseline_trials = [t for t in stored["trials"] if t["role"] == "baseline"]
    top = max(t["samples_per_s"] for t in baseline_trials)
    close = [t for t in baseline_trials if t["samples_per_s"] >= 0.9 * top]
    baseline_best = min(close, key=lambda t: t["setting"]["torch_threads"])
    configs = apply(spec, expand(spec), calibration)
    base = next(c for c in configs if c.baseline)
    plan = baseline_plan(spec, base)
    threads = plan.args[plan.args.index("--torch-threads") + 1]
    assert int(threads) == baseline_best["setting"]["torch_threads"]
    assert plan.env["OMP_WAIT_POLICY"] == "PASSIVE"
    for config in (c for c in configs if not c.baseline):
        for peer in peer_plans(spec, config):
            workers = peer.args[peer.args.index("--num-workers") + 1]
            assert int(workers) == config.train.num_workers
            assert peer.args[peer.args.index("--torch-threads") + 1] == "1"
        assert config.describe()["tuning"]["per_cpus"]["1"]["torch_threads"] == 1
    # The same spec reuses the file (no process runs: the trials are the stored ones) ...
    stamp = (tmp_path / CALIBRATION_FILE).stat().st_mtime_ns
    again = calibrate(spec, tmp_path)
    assert again == calibration and (tmp_path / CALIBRATION_FILE).stat().st_mtime_ns == stamp
    # ... and a spec the measurements depend on does not.
    other = parse_spec({**spec_data(wait_policies=["PASSIVE"]), "task": {"name": "synthetic"}})
    assert calibration_key(other) != calibration.key


def test_a_failing_setting_is_recorded_and_never_chosen(tmp_path: Path):
    data = spec_data(wait_policies=["PASSIVE"])
    data["task"]["options"] = {"hidden_dim": 0}  # the task cannot build: every probe fails
    spec = parse_spec(data)
    calibration = calibrate(spec, tmp_path)
    assert all(t.samples_per_s is None and "hidden_dim" in t.error for t in calibration.trials)
    assert all(c.tuning is None for c in apply(spec, expand(spec), calibration))
    assert Calibration.from_json(calibration.to_json()) == calibration


def test_repeats_are_pooled_by_their_median():
    fast, slow = Setting(2, 1, "PASSIVE", 0), Setting(2, 2, "PASSIVE", 0)
    trials = [
        Trial("baseline", fast, 100.0), Trial("baseline", slow, 300.0),
        Trial("baseline", slow, 50.0), Trial("baseline", fast, 90.0),
        Trial("baseline", slow, 60.0), Trial("baseline", fast, None, "exit 1"),
    ]  # fmt: skip
    calibration = Calibration("k", trials)
    best = calibration.best("baseline", 2)
    # slow's one lucky repeat (300) does not win: medians 95 (fast) against 60 (slow)
    assert best is not None and best.setting == fast and best.samples_per_s == 95.0
    rows = {row[2]: row for row in settings_table(calibration)}
    assert rows["1"][5] == "95.0 (100.0, 90.0, -)" and rows["1"][6] == "fastest"
    assert rows["2"][5] == "60.0 (300.0, 50.0, 60.0)" and rows["2"][6] == ""


def test_a_near_tie_goes_to_the_least_fragile_setting():
    spinning, passive = Setting(2, 2, "ACTIVE", 0), Setting(2, 2, "PASSIVE", 0)
    one_thread = Setting(2, 1, "PASSIVE", 0)
    calibration = Calibration(
        "k",
        [
            Trial("baseline", spinning, 100.0),
            Trial("baseline", passive, 92.0),
            Trial("baseline", one_thread, 80.0),
        ],
    )
    # 92 is within 10% of 100: passive threads, which degrade gently under load, win
    assert calibration.best("baseline", 2).setting == passive
    clear = Calibration("k", [Trial("baseline", spinning, 100.0), *calibration.trials[1:2]])
    assert clear.best("baseline", 2).setting == passive
    far = Calibration("k", [Trial("baseline", spinning, 130.0), Trial("baseline", passive, 92.0)])
    assert far.best("baseline", 2).setting == spinning
