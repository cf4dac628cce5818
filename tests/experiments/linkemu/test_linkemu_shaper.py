"""The link emulator's per-direction model (no namespaces): loss, rate, queue, delay, order."""

from __future__ import annotations

import pytest

from experiments.linkemu.shaper import MIN_QUEUE_BYTES, LinkShape, Shaper

pytestmark = pytest.mark.timeout(30)


def test_frames_leave_at_the_rate_then_spend_the_delay():
    shaper = Shaper(LinkShape(rate_bit_per_s=8e6, delay_s=0.02))  # 1 byte per microsecond
    dues = [shaper.admit(0.0, 1000) for _ in range(3)]
    assert dues == pytest.approx([0.021, 0.022, 0.023])
    # an idle link: a frame arriving later is serialized from its arrival
    assert shaper.admit(1.0, 500) == pytest.approx(1.0 + 0.0005 + 0.02)


def test_a_full_queue_drops_the_tail():
    shape = LinkShape(rate_bit_per_s=8e6, queue_s=0.01)  # 10,000 bytes, below the floor
    shaper = Shaper(shape)
    admitted = sum(shaper.admit(0.0, 1000) is not None for _ in range(100))
    assert admitted == MIN_QUEUE_BYTES // 1000
    assert shaper.stats.num_tail_dropped == 100 - admitted
    assert shaper.admit(10.0, 1000) is not None  # drained meanwhile


def test_loss_drops_the_configured_fraction_reproducibly():
    def lost(seed: int) -> int:
        shaper = Shaper(LinkShape(loss=0.05), seed=seed)
        return sum(shaper.admit(i * 1e-3, 100) is None for i in range(20_000))

    assert lost(1) == lost(1)
    assert 0.05 * 0.9 < lost(1) / 20_000 < 0.05 * 1.1


def test_jitter_varies_the_delay_but_never_reorders():
    shaper = Shaper(LinkShape(delay_s=0.05, jitter_s=0.01), seed=3)
    dues = [shaper.admit(i * 1e-3, 100) for i in range(2000)]
    assert dues == sorted(dues)
    delays = [due - i * 1e-3 for i, due in enumerate(dues)]
    assert min(delays) >= 0.05 - 0.04 and max(delays) > 0.06


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("rate_bit_per_s", 0.0, "rate_bit_per_s"), ("loss", 1.5, "loss"), ("delay_s", -1, "delay_s")],
)
def test_bad_shapes_are_refused_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        LinkShape(**{field: value})
