# Types of the lazy re-exports of peer/__init__.py (which must stay free of import statements
# that reach torch: tests/test_layering.py follows every import, TYPE_CHECKING blocks included).
from dht.config import get_dht_time as get_dht_time
from peer.api.dht import DHT as DHT
from peer.api.optimizer import Optimizer as Optimizer
from peer.api.profile import profile as profile

__all__ = ["DHT", "Optimizer", "get_dht_time", "profile"]
