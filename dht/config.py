"""The settings a user passes, in one place: what a node does and how it talks.

:class:`DHTConfig` (owned by :mod:`dht.kademlia.config`) says how a node finds others and
replicates values; :class:`TransportConfig` (owned by :mod:`dht.net.config`) says how it listens,
what it spends on others and how it gets through NAT. :func:`get_dht_time` is the clock that
expirations are measured on.
"""

from dht.kademlia.config import Clock, DHTConfig, SystemClock, get_dht_time
from dht.net.config import PortMappingConfig, ReachabilityConfig, TransportConfig

__all__ = [
    "Clock",
    "DHTConfig",
    "PortMappingConfig",
    "ReachabilityConfig",
    "SystemClock",
    "TransportConfig",
    "get_dht_time",
]
