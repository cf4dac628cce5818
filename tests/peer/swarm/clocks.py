"""Fake clocks for the holds' tests: a monotonic clock and the DHT's, advanced together."""

from __future__ import annotations

NOW = 1_000_000.0  # the DHT time the tests start at


class Clocks:
    def __init__(self) -> None:
        self.monotonic_s = 50.0
        self.dht_s = NOW

    def injected(self) -> dict:
        """The keyword arguments that give a hold these clocks."""
        return {"monotonic": lambda: self.monotonic_s, "dht_time": lambda: self.dht_s}

    def advance(self, seconds: float) -> None:
        self.monotonic_s += seconds
        self.dht_s += seconds
