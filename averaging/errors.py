"""The one exception tree of the ``averaging`` package.

Errors of the ``dht`` layer (transport, DHT) are translated at the boundary (see
:func:`translate`), so callers of :mod:`averaging` catch :class:`AveragingError` only. A failed
or partial round is not an exception: it is a :class:`averaging.result.RoundResult` with a reason.
"""

from __future__ import annotations

from dht.errors import DHTError, RemoteError, RequestTimeoutError


class AveragingError(Exception):
    """Base class of every error raised by the ``averaging`` package."""


class ConfigError(AveragingError, ValueError):
    """A configuration value or argument is invalid; the message names the field."""


class NetworkError(AveragingError):
    """A request to another peer failed (refused, reset, closed or timed out)."""


class PeerTimeoutError(NetworkError, TimeoutError):
    """Another peer did not answer or send within its timeout."""


class RefusedError(NetworkError):
    """Another peer refused a request; ``reason`` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class ProtocolViolation(AveragingError):
    """A peer sent something the averaging protocol does not allow (bad header, bad chunk)."""


class BadChunkError(ProtocolViolation):
    """A tensor chunk is malformed: wrong size, out of order, NaN/Inf, undecodable."""


def translate(error: DHTError) -> AveragingError:
    """The averaging error that stands for a transport/DHT ``error`` (chain it with ``from``)."""
    if isinstance(error, RequestTimeoutError):
        return PeerTimeoutError(str(error))
    if isinstance(error, RemoteError):
        return RefusedError(error.reason)
    return NetworkError(str(error))


def describe_failure(error: BaseException, timeout_s: float) -> str:
    """A one-line reason for a failed stream."""
    if isinstance(error, TimeoutError) and not str(error):
        return f"stalled: nothing for {timeout_s} s"
    return f"{type(error).__name__}: {error}"
