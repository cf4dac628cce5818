"""Refusals of the node's server: the typed exceptions, the answer a refusal is, the quiet
treatment of malformed HTTP and of callers that hang up, and reading a body charged as it arrives.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from dht.errors import (
    AuthError,
    BadMessageError,
    BusyError,
    DHTError,
    StreamAbortedError,
    ValidationError,
)
from dht.net.client import RENEW_HEADER
from dht.net.shares import Account

# A stream's caller that aborts it (an error frame) before the reply is refused input: 400.
_STATUS_OF = {
    BadMessageError: 400,
    StreamAbortedError: 400,
    AuthError: 401,
    ValidationError: 422,
    BusyError: 429,
}


class _MalformedHttpFilter(logging.Filter):
    """Malformed HTTP from a stranger (too many headers, a line too long) is a WARNING without
    a traceback, at most one line per second; other errors pass untouched (they are bugs)."""

    def __init__(self):
        super().__init__()
        self._last_s = -float("inf")
        self.num_dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        now = time.monotonic()
        if now - self._last_s < 1.0:
            self.num_dropped += 1
            return False
        self._last_s = now
        # the message is final here: it quotes the request, whose bytes are the caller's and
        # may hold a '%s' that formatting with the record's arguments would choke on
        record.msg = f"{record.getMessage()}: {exc.code} {exc.message}"[:300]
        record.args = ()
        record.exc_info, record.exc_text = None, None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


# The logger aiohttp's request handlers report malformed requests to (see HttpTransport.start).
HTTP_PARSER_LOGGER = logging.getLogger("dht.net.server.parser")
HTTP_PARSER_LOGGER.addFilter(_MalformedHttpFilter())


class ClientGone(Exception):
    """The caller hung up (or cut its body short) while its request was read: nobody is left
    to answer, so it is a DEBUG line, not a refusal."""


class Refused(Exception):
    """A request refused with an HTTP status and a one-line reason.

    Args:
        status: the HTTP status (4xx, 5xx).
        reason: one line, sent in the ``x-vp-error`` header and the body.
        renew: tell the caller to make a new session (an unknown or expired ticket).
        retry_after_s: a ``Retry-After`` to announce, in whole seconds (None: none).
        hold_s: wait this long before answering, in seconds (a sender that ignored the last
            ``Retry-After`` it was told: see :mod:`dht.net.request_shares`).
    """

    def __init__(
        self,
        status: int,
        reason: str,
        *,
        renew: bool = False,
        retry_after_s: int | None = None,
        hold_s: float = 0.0,
    ):
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.renew = renew
        self.retry_after_s = retry_after_s
        self.hold_s = hold_s


def status_of(error: DHTError) -> int:
    for kind, status in _STATUS_OF.items():
        if isinstance(error, kind):
            return status
    return 500


def error_response(
    status: int, reason: str, *, renew: bool = False, retry_after_s: int | None = None
) -> web.Response:
    # A reason may quote the request: only printable ASCII goes into a header (aiohttp would
    # refuse a control character and drop the connection instead of answering).
    safe = "".join(c if " " <= c <= "~" else "?" for c in reason[:300])
    headers = {"x-vp-error": safe}
    if renew:
        headers[RENEW_HEADER] = "renew"
    if retry_after_s is not None:
        headers["retry-after"] = str(retry_after_s)
    return web.Response(status=status, text=safe, headers=headers)


async def read_charged(source, max_bytes: int, account: Account, stall_timeout_s: float) -> bytes:
    """Read ``source`` (aiohttp's StreamReader) to its end, charging ``account`` for each block
    as it arrives; a body past ``max_bytes`` is a 413, a wait of ``stall_timeout_s`` for the
    next block a TimeoutError, a caller that hung up :class:`ClientGone`."""
    chunks, num_bytes = [], 0
    while True:
        try:
            async with asyncio.timeout(stall_timeout_s):
                chunk = await source.read(max_bytes + 1 - num_bytes)
        except TimeoutError:
            raise
        except Exception as e:  # aiohttp's payload errors: the caller hung up or cut its body
            raise ClientGone(f"{type(e).__name__}: {e}") from None
        if not chunk:
            return b"".join(chunks)
        num_bytes += len(chunk)
        if num_bytes > max_bytes:
            raise Refused(413, f"body exceeds the limit of {max_bytes} bytes")
        account.charge(len(chunk))
        chunks.append(chunk)
