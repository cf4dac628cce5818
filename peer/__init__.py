"""The training peer and the `peer` command line; as a library, a drop-in for hivemind's API.

``peer.DHT``, ``peer.Optimizer`` and ``peer.profile`` load on first use: the dashboard imports
:mod:`peer.records`, which imports this package, and must not pull torch in (the names are
resolved by module path here, so that no import statement reaches torch; types are in
``__init__.pyi``).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["DHT", "Optimizer", "get_dht_time", "profile"]
_EXPORTS = {
    "DHT": "peer.api.dht",
    "Optimizer": "peer.api.optimizer",
    "profile": "peer.api.profile",
    "get_dht_time": "dht.config",  # the clock of expiration times (hivemind.get_dht_time's)
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'peer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
