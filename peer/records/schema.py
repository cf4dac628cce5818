"""The one strict boundary for records read from the DHT: typed, ranged fields and drop counts.

Every record a peer publishes (progress, profile, rounds, state announcements) is parsed here by a
pydantic model in strict mode: an int field takes only an int (no string of digits, no bool, no
float), a float field takes an int or a finite float, and every number has a range. Counts and
epochs stay below 2**53, so that they convert to float exactly and pack as msgpack integers; rates
and byte rates are finite and capped; addresses are ``http(s)://host:port`` URLs. Unknown fields
are ignored, so that newer publishers stay readable. A record that fails is dropped and counted
(:data:`rejects`), with at most one log line per kind of record per ``LOG_INTERVAL_S``: a flood of
bad records costs a counter, not a log.

Torch-free and numpy-free, like everything in :mod:`peer.records` (the dashboard imports it).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from typing import Annotated, Any, TypeVar
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from dht.identity import is_peer_id
from dht.kademlia.validation import subkey_owner
from dht.net.schema import is_relayed_path

logger = logging.getLogger(__name__)

MAX_COUNT = 2**53 - 1  # counts and epochs: exact as floats, packable as msgpack ints
MAX_TIME_S = 1e11  # unix seconds (the year 5138): larger is no clock
MAX_RATE = 1e12  # samples or bytes per second: beyond any machine
MAX_ADDRESS_CHARS = 300
LOG_INTERVAL_S = 60.0

Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Seconds = Annotated[float, Field(ge=0.0, le=MAX_TIME_S)]
Rate = Annotated[float, Field(ge=0.0, le=MAX_RATE)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]


def check_peer_url(url: str) -> str:
    """``url`` if it is ``http(s)://host:port`` (an optional ``/`` at the end, nothing else) or
    a relayed peer's ``http(s)://host:port/v2/relay/{peer id}``.

    Raises:
        ValueError: it is not.
    """
    if not (0 < len(url) <= MAX_ADDRESS_CHARS and url.isascii() and url.isprintable()):
        raise ValueError("an address is 1 to 300 printable ASCII characters")
    if any(c.isspace() for c in url):
        raise ValueError("an address has no spaces")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"not a URL: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise ValueError("an address is http(s)://host:port")
    if parts.username or parts.password:
        raise ValueError("an address has no user or password")
    if parts.path not in ("", "/") and not is_relayed_path(parts.path):
        raise ValueError("an address has no path but a relayed peer's /v2/relay/PEER_ID")
    if parts.query or parts.fragment or port == 0:
        raise ValueError("an address has no query or fragment, and a port above 0")
    return url


def check_multiaddr(address: str) -> str:
    """``address`` if it looks like a libp2p multiaddr (the hivemind backend's addresses)."""
    if not (0 < len(address) <= MAX_ADDRESS_CHARS and address.isascii()):
        raise ValueError("an address is 1 to 300 ASCII characters")
    if not address.startswith("/") or any(c.isspace() for c in address):
        raise ValueError("a multiaddr starts with / and has no spaces")
    return address


PeerUrl = Annotated[str, AfterValidator(check_peer_url)]


def _finite_or_none(value: Any) -> Any:
    """A loss that is NaN or infinite is shown as unknown (an honest peer can diverge)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


Loss = Annotated[float | None, BeforeValidator(_finite_or_none)]


def text(max_chars: int) -> Any:
    """A string field of at most ``max_chars`` characters."""
    return Annotated[str, Field(max_length=max_chars)]


class WireModel(BaseModel):
    """Base of every record schema: strict types, finite numbers, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, allow_inf_nan=False)


Model = TypeVar("Model", bound=WireModel)


class Rejects:
    """Counts the records dropped at the boundary, per kind, and logs now and then.

    Thread-safe: the training peer's loop thread and the dashboard's worker both parse.
    """

    def __init__(self, interval_s: float = LOG_INTERVAL_S):
        self.counts: Counter[str] = Counter()
        self._interval_s = interval_s
        self._last_log: dict[str, float] = {}
        self._since_log: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, kind: str, peer_id: str | None, reason: str) -> None:
        """Count one dropped record of ``kind``; log one line per kind per interval."""
        now = time.monotonic()
        with self._lock:
            self.counts[kind] += 1
            self._since_log[kind] += 1
            if now - self._last_log.get(kind, -math.inf) < self._interval_s:
                return
            self._last_log[kind] = now
            num_dropped, self._since_log[kind] = self._since_log[kind], 0
        logger.warning(
            "dropped %d malformed %s record(s) (latest from %s: %s)",
            num_dropped,
            kind,
            (peer_id or "an unknown owner")[:8],
            reason[:200],
        )


rejects = Rejects()


def _reason(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first.get("loc", ())) or "value"
    return f"{where}: {first.get('msg', 'invalid')}"


def owner_of(subkey: object) -> str | None:
    """The peer id a record's subkey names (records are signed by it), or None."""
    owner = subkey_owner(subkey) if isinstance(subkey, str) else None
    return owner if is_peer_id(owner) else None


def parse_value(model: type[Model], kind: str, peer_id: str | None, value: object) -> Model | None:
    """``value`` as ``model``, or None (counted in :data:`rejects`) when it does not fit.

    Never raises for anything ``value`` holds.
    """
    if peer_id is None:
        rejects.add(kind, None, "the subkey names no owner")
        return None
    try:
        return model.model_validate(value)
    except ValidationError as e:
        rejects.add(kind, peer_id, _reason(e))
    except (TypeError, ValueError, OverflowError, RecursionError) as e:
        rejects.add(kind, peer_id, f"{type(e).__name__}: {e}")
    return None
