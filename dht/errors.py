"""The one exception tree of the ``dht`` package.

Everything the transport and the DHT raise derives from :class:`DHTError`; aiohttp, msgpack and
cryptography errors are translated at the boundary so that callers (``averaging``, ``peer``) never
need to import those libraries to handle a failure.
"""

from __future__ import annotations


class DHTError(Exception):
    """Base class of every error raised by the ``dht`` package."""


class ConfigError(DHTError, ValueError):
    """A configuration value is invalid; the message names the field."""


class IdentityError(DHTError):
    """A peer identity file is missing, unreadable, malformed or too widely readable."""


class TransportError(DHTError):
    """A request to another node could not be completed (refused, reset, closed)."""


class RequestTimeoutError(TransportError, TimeoutError):
    """A network wait exceeded its configured timeout."""


class RemoteError(TransportError):
    """The remote node answered with an error status.

    Attributes:
        status: the HTTP status code (4xx for refused input, 5xx for a failure of the remote).
        reason: the remote's one-line explanation.
    """

    def __init__(self, status: int, reason: str):
        super().__init__(f"remote refused with {status}: {reason}")
        self.status = status
        self.reason = reason


class StreamAbortedError(RemoteError):
    """The other end of a stream ended it early with an error frame (its reason is here);
    a server answers a caller's abort before its reply with a 400."""

    def __init__(self, reason: str):
        super().__init__(409, reason)


class BadMessageError(DHTError):
    """A message is malformed or exceeds a limit (size, depth, length)."""


class AuthError(DHTError):
    """A message's swarm MAC is missing, wrong or stale."""


class ValidationError(DHTError):
    """A DHT record was refused by a validator (bad signature, replay, wrong owner)."""


class BusyError(DHTError):
    """The node refuses more work from this sender for now (too many concurrent streams)."""


class WrongPeerError(TransportError):
    """Another peer than the one expected answers at an address (proven by its handshake).

    Attributes:
        expected: the peer id the caller asked for.
        actual: the peer id that proved itself at that address.
    """

    def __init__(self, address: str, expected: str, actual: str):
        super().__init__(f"{address} is peer {actual[:8]}, not the expected {expected[:8]}")
        self.expected = expected
        self.actual = actual
