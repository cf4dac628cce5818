"""The replay guard's memory is shared fairly: one sender's flood moves only its own floor."""

from __future__ import annotations

import pytest

from dht.errors import AuthError
from dht.net.replay import ReplayGuard


def test_a_flood_stamped_in_the_future_refuses_only_its_sender():
    guard = ReplayGuard(window_s=30.0, max_entries=800)
    now = 1_000_000.0
    guard.check("honest", "n0", repr(now - 1), now_s=now)
    for index in range(5000):  # far beyond every cap, 29 s in the future
        guard.check("flood", f"f{index}", repr(now + 29 + index * 1e-6), now_s=now)
    assert len(guard) <= 800
    for index in range(1, 50):  # the honest sender is served as before
        guard.check("honest", f"n{index}", repr(now + index * 0.01), now_s=now)
    with pytest.raises(AuthError, match="older than"):  # the flooder's own floor moved
        guard.check("flood", "late", repr(now + 1), now_s=now)
    with pytest.raises(AuthError, match="replayed"):
        guard.check("honest", "n5", repr(now + 0.05), now_s=now)


def test_many_senders_over_the_cap_raise_only_their_own_floors():
    guard = ReplayGuard(window_s=30.0, max_entries=80)
    now = 1_000_000.0
    for sender in range(40):
        for index in range(5):
            guard.check(f"s{sender}", f"n{index}", repr(now + index), now_s=now)
    assert len(guard) <= 80
    guard.check("newcomer", "x", repr(now - 10), now_s=now)  # no floor of its own
