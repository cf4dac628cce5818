# Types of the lazy re-exports of peer/__init__.py (which must stay free of import statements
# that reach torch: tests/test_layering.py follows every import, TYPE_CHECKING blocks included).
from peer.api.dht import DHT as DHT
from peer.api.optimizer import Optimizer as Optimizer
from peer.api.profile import profile as profile

__all__ = ["DHT", "Optimizer", "profile"]
