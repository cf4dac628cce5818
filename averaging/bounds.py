"""What one member may claim in a group: bounds on weights, bandwidths and addresses.

A group description comes from its leader, and each entry from a member: all of it is a claim.
Every member derives the same bounded values from the same description, so no message is needed
to agree on them:

* **Weights** are 0 (takes part without contributing) or in ``[MIN_WEIGHT, MAX_WEIGHT]``; then
  each counts at most ``max_weight_ratio`` times the lower median of the positive weights
  (:func:`bounded_weights`). One member's share of the average is then at most
  ``r / (r + n - 1)`` in a group of ``n`` contributors (``r`` the ratio): a huge weight no
  longer makes a member the whole average, and an honest group of similar peers is unchanged.
* **Bandwidths** are finite, in ``[0, MAX_BANDWIDTH]``, and each counts at most
  :data:`MAX_BANDWIDTH_RATIO` times the lower median of the reducers' (:func:`fair_bandwidths`),
  so no member (a leader included) can give itself more than its fair share of the parts.
* **Addresses** are ``http(s)://host:port`` URLs (:func:`check_address`).

Values are bounded so that the reducer's arithmetic cannot overflow: each weighted contribution
must stay within ``FLOAT32_MAX / n`` (see :mod:`averaging.allreduce.reducer`), so their sum is
finite.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from urllib.parse import urlsplit

import numpy as np

from dht.net.schema import is_relayed_path

MIN_WEIGHT = 2.0**-20
MAX_WEIGHT = 2.0**53
MAX_BANDWIDTH = 1e12
MAX_BANDWIDTH_RATIO = 4.0
DEFAULT_MAX_WEIGHT_RATIO = 8.0
MAX_WEIGHT_RATIO = 1e6
MAX_CHUNK_NUMEL = 2 * 1024 * 1024  # 8 MiB of float32: the transport's default frame limit
DEFAULT_CHUNK_NUMEL = 1024 * 1024  # 4 MiB of float32: fewer, larger writes cost less CPU
MAX_STREAMS_PER_PAIR = 8  # a server admits 8 streams per peer at once (dht.net.config)
MAX_ADDRESS_CHARS = 300
FLOAT32_MAX = float(np.finfo(np.float32).max)


def is_number(value: object) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def valid_weight(value: object) -> bool:
    """0, or a finite number in ``[MIN_WEIGHT, MAX_WEIGHT]``."""
    return is_number(value) and (value == 0 or MIN_WEIGHT <= value <= MAX_WEIGHT)


def valid_bandwidth(value: object) -> bool:
    """A finite number in ``[0, MAX_BANDWIDTH]``."""
    return is_number(value) and 0 <= value <= MAX_BANDWIDTH


def check_address(address: object) -> bool:
    """Whether ``address`` is ``http(s)://host:port`` (an optional ``/``, nothing more), or a
    relayed peer's ``http(s)://host:port/v2/relay/{peer id}``."""
    if not (isinstance(address, str) and 0 < len(address) <= MAX_ADDRESS_CHARS):
        return False
    if not (address.isascii() and address.isprintable()) or " " in address:
        return False
    try:
        parts = urlsplit(address)
        port = parts.port
    except ValueError:
        return False
    return (
        parts.scheme in ("http", "https")
        and bool(parts.hostname)
        and port is not None
        and port > 0
        and not (parts.username or parts.password or parts.query or parts.fragment)
        and (parts.path in ("", "/") or is_relayed_path(parts.path))
    )


def _lower_median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def bounded_weights(weights: Sequence[float], max_ratio: float) -> list[float]:
    """``weights`` with each capped at ``max_ratio`` times the lower median of the positive
    ones (the same on every member; zeros stay zero)."""
    positive = [w for w in weights if w > 0]
    if not positive:
        return [float(w) for w in weights]
    cap = max_ratio * _lower_median(positive)
    return [float(min(w, cap)) for w in weights]


def fair_bandwidths(bandwidths: Sequence[float]) -> list[float]:
    """``bandwidths`` with each capped at :data:`MAX_BANDWIDTH_RATIO` times the lower median of
    the positive ones (zeros, the client-mode members, stay zero)."""
    positive = [b for b in bandwidths if b > 0]
    if not positive:
        return [float(b) for b in bandwidths]
    cap = MAX_BANDWIDTH_RATIO * _lower_median(positive)
    return [float(min(b, cap)) for b in bandwidths]


def value_limit(num_contributors: int) -> float:
    """The largest magnitude one weighted contribution may have when ``num_contributors`` are
    summed: their sum then stays a finite float32."""
    return FLOAT32_MAX / max(1, num_contributors)
