"""``peer.bench.pairs``: pairwise ratios, their median and spread, the order of windows."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from peer.bench.pairs import (
    aba,
    interleave,
    pair_order,
    paired_runs,
    pairwise_ratios,
    quartiles,
    rate_between,
    spread,
)
from peer.bench.windows import MetricsFiles

pytestmark = pytest.mark.timeout(60)
values = st.lists(st.floats(0.01, 1e6, allow_nan=False), min_size=1, max_size=50)


@given(values)
def test_quartiles_match_numpy(xs):
    assert quartiles(xs) == pytest.approx(tuple(np.percentile(xs, [25, 50, 75])), rel=1e-9)


def test_spread_of_known_ratios():
    result = spread([1.0, 0.9, 1.1, 1.3, 0.5])
    assert result.ratio_p50 == 1.0
    assert result.ratio_iqr == pytest.approx(1.1 - 0.9)
    assert (result.ratio_min, result.ratio_max, result.num_pairs) == (0.5, 1.3, 5)
    assert json.loads(json.dumps(result.fields()))["ratios"] == [1.0, 0.9, 1.1, 1.3, 0.5]
    with pytest.raises(ValueError):
        spread([])


def test_pairwise_ratios_leave_out_unmeasured_pairs():
    assert pairwise_ratios([2.0, None, 3.0, 4.0], [1.0, 1.0, None, 0.0]) == [2.0]
    with pytest.raises(ValueError):
        pairwise_ratios([1.0], [1.0, 2.0])


def test_pairs_alternate_which_side_goes_first():
    assert pair_order(4) == [(0, 1), (1, 0), (0, 1), (1, 0)]
    with pytest.raises(ValueError):
        pair_order(0)


class _Host:
    """A simulated machine whose speed drifts linearly (2% per second); a side doing ``work``
    per second of an idle machine reports ``work * speed`` at the middle of its window."""

    def __init__(self, work: dict[str, float]):
        self.now, self.work = 0.0, work

    def side(self, name: str):
        def measure(window_s: float) -> float:
            speed = 1.0 - 0.02 * (self.now + window_s / 2)
            self.now += window_s
            return self.work[name] * speed

        return measure


def test_interleaved_windows_cancel_a_linear_drift_that_biases_aba_less():
    host = _Host({"a": 100.0, "b": 90.0})  # true ratio 0.9
    result = interleave(host.side("a"), host.side("b"), num_pairs=10, window_s=1.0)
    assert result.spread.ratio_p50 == pytest.approx(0.9, rel=0.02)
    assert result.median_rate(0) > result.median_rate(1)
    assert len(result.rates_a) == len(result.rates_b) == 10 and result.window_s == 1.0
    # A B B A: the drift moves every pair's ratio, alternately up and down, by the same amount
    ups, downs = result.spread.ratios[0::2], result.spread.ratios[1::2]
    assert max(ups) < 0.9 < min(downs)


def test_aba_compares_the_middle_with_both_ends():
    host = _Host({"a": 100.0, "b": 100.0})
    assert aba(host.side("a"), host.side("b"), seconds=10.0) == pytest.approx(1.0, abs=1e-9)
    assert aba(lambda s: None, lambda s: 1.0, seconds=1.0) is None


def test_interleave_needs_one_measured_pair():
    with pytest.raises(ValueError, match="no pair"):
        interleave(lambda s: None, lambda s: 1.0, num_pairs=2, window_s=0.1)
    with pytest.raises(ValueError):
        interleave(lambda s: 1.0, lambda s: 1.0, num_pairs=2, window_s=0)


def test_rate_between_counts_work_after_the_first_point_inside():
    # a line every 0.5 s reporting the samples since the previous line (100 per line)
    points = [(t / 2, 100.0) for t in range(0, 21)]
    assert rate_between(points, 1.0, 3.0) == pytest.approx(200.0)  # 4 lines after t=1.0
    assert rate_between(points, 1.1, 1.4) is None  # no line inside
    assert rate_between(points, 1.0, 1.2) is None  # one line only


def test_metrics_files_read_lines_as_they_grow(tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"  # b: not created yet
    files = MetricsFiles([first, second])
    assert not files.started()
    first.write_text('{"t": 0, "samples": 0}\n{"t": 1, "samp')
    files.refresh()
    assert files.points[0] == [(0.0, 0.0)]  # the half-written line waits
    with first.open("a") as f:
        f.write('les": 64}\n{"t": 2, "samples": 64}\n')
    assert files.rate(0.0, 2.0) is None  # the second process wrote nothing
    assert not files.started()
    second.write_text('{"t": 0.5, "samples": 10}\n{"t": 1.5, "samples": 32}\n')
    assert files.started()
    assert files.points[0] == [(0.0, 0.0), (1.0, 64.0), (2.0, 64.0)]
    assert files.rate(0.0, 2.0) == pytest.approx(64.0 + 32.0)


def test_paired_runs_take_turns():
    calls = []
    a, b = paired_runs(lambda: calls.append("a") or 1, lambda: calls.append("b") or 2, num_pairs=3)
    assert calls == ["a", "b", "b", "a", "a", "b"] and a == [1, 1, 1] and b == [2, 2, 2]


def test_repeated_train_bench_reports_the_run_with_the_median_ratio(monkeypatch):
    from peer.bench import train

    ratios = iter([1.2, 0.9, 1.0, 0.8])
    monkeypatch.setattr(
        train, "run_train_bench", lambda config: {"ratio": next(ratios), "samples_per_s": 1.0}
    )
    result = train.run_train_bench_repeated(train.TrainBenchConfig(), 4)
    # the lower middle of an even count: the worse of the two middle runs
    assert result["ratio"] == 0.9 and result["runs_ratio"] == [1.2, 0.9, 1.0, 0.8]


def test_the_matched_baseline_has_the_swarms_shape():
    from peer.bench.train_config import TrainBenchConfig
    from peer.bench.train_windows import baseline_shapes

    # (torch threads, data seed) per plain loop: peer i's threads and seed
    assert baseline_shapes(TrainBenchConfig(num_peers=2, num_threads=2)) == [(1, 0), (1, 1)]
    assert baseline_shapes(TrainBenchConfig(num_peers=3, num_threads=2)) == [(1, 0), (1, 1), (1, 2)]
    assert baseline_shapes(TrainBenchConfig(num_peers=1, num_threads=2)) == [(2, 0)]
    single = TrainBenchConfig(num_peers=2, num_threads=2, baseline="single")
    assert baseline_shapes(single) == [(2, 0)]
    with pytest.raises(ValueError, match="baseline"):
        TrainBenchConfig(baseline="double")
