"""The server's listening sockets, whose ``accept`` asks the connection gate first.

asyncio accepts a new connection with the listening socket's ``accept()`` and then builds a
transport, aiohttp's protocol (an HTTP parser) and a task for it, tens of microseconds whatever
the connection then does. A sender that comes back in a new connection after every refusal makes
that the cost of each try. Here ``accept()`` itself asks :meth:`ConnectionGate.admit` (the open
connections' caps and the address's share of new connections) and resets a refused connection
at once (``SO_LINGER`` 0: an RST, no TIME_WAIT), so that asyncio never sees it: a refusal costs
the accept system call, one token-bucket check and a close.

Only asyncio's selector event loops accept through the socket object's ``accept()``. Another loop
(uvloop, which accepts in libuv; the Windows proactor) never calls it: there the gate checks each
new connection once aiohttp has set it up (:meth:`ConnectionGate.install`), so the shares hold
all the same, at the cost of that set-up per refused connection (logged once at start). Nothing
in the project installs such a loop.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import struct

from aiohttp import web

from dht.net.limits import ConnectionGate

logger = logging.getLogger(__name__)

# An accept() call resets at most this many refused connections before it lets the event loop
# run (it comes back for the rest on its next turn: the socket is still readable).
MAX_REFUSED_PER_ACCEPT = 64
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends an RST


def accept_is_gated(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` accepts through the listening socket's ``accept()`` (asyncio's selector
    loops), where :class:`GatedSocket` refuses before anything is built."""
    return isinstance(loop, asyncio.selector_events.BaseSelectorEventLoop)


class GatedSocket(socket.socket):
    """A listening TCP socket whose ``accept()`` returns only connections ``gate`` admits.

    Args:
        gate: the server's connection gate (set after construction: ``sock.gate = gate``).
    """

    gate: ConnectionGate

    def accept(self) -> tuple[socket.socket, object]:
        for _ in range(MAX_REFUSED_PER_ACCEPT):
            conn, addr = super().accept()  # BlockingIOError once none is waiting
            host = addr[0] if isinstance(addr, tuple) and addr else ""
            if self.gate.admit(str(host)):
                self.gate.checked_at_accept(addr)
                return conn, addr
            try:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            except OSError:  # (it already went away)
                pass
            conn.close()
        raise BlockingIOError("refused connections at the gate; more may be waiting")


async def listening_sockets(
    host: str | None, port: int, gate: ConnectionGate, *, backlog: int = 128
) -> list[GatedSocket]:
    """Bound, listening sockets for ``host`` (each address it resolves to, as asyncio's
    ``create_server`` binds) and ``port`` (0: a free one), gated by ``gate``.

    Raises:
        OSError: an address could not be bound (all sockets made so far are closed).
    """
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    sockets: list[GatedSocket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = GatedSocket(family, kind, proto)
            sockets.append(sock)
            sock.gate = gate
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # (as asyncio: one socket per family)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


async def start_gated_sites(
    runner: web.BaseRunner,
    host: str | None,
    port: int,
    gate: ConnectionGate,
    *,
    ssl_context: ssl.SSLContext | None = None,
) -> None:
    """Serve ``runner`` on :func:`listening_sockets` (an aiohttp site each), as a ``TCPSite``
    would on ``host`` and ``port``.

    Raises:
        OSError: an address could not be bound or served (nothing is left open).
    """
    sockets = await listening_sockets(host, port, gate)
    loop = asyncio.get_running_loop()
    if not accept_is_gated(loop):
        logger.info(
            "%s accepts without the listening socket's accept(): new connections are checked "
            "against their address's share once set up",
            type(loop).__name__,
        )
    try:
        for sock in sockets:
            await web.SockSite(runner, sock, ssl_context=ssl_context).start()
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
