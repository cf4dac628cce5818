"""Fixtures of the adversarial suite: the averaging tests' real in-process peers."""

from tests.averaging.conftest import make_peers, make_swarm  # noqa: F401 (fixtures)
