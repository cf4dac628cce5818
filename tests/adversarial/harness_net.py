"""A malicious peer's toolbox for the network layer, and honest DHT nodes in processes.

* :class:`WireClient` speaks the transport's wire protocol by hand (handshake, signed headers,
  frames) over a plain aiohttp session, so a test can lie at any step: another peer's id, a body
  that is not what the MAC covers, a ``Content-Length`` that is not the body's, a replay to
  another node, headers without end.
* :class:`NodeProcess` runs an honest DHT node in its own process (``net_worker.py``) and asks it
  about itself (routing table, storage, memory, refusals) over stdin/stdout, one JSON per line.
  Whatever the worker logs goes to a file; :meth:`NodeProcess.crashes` finds tracebacks in it.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import aiohttp
import pytest

from dht.identity import PeerIdentity
from dht.net.auth import SwarmAuth
from dht.net.client import HELLO_PATH, signed_headers
from dht.net.session import PendingHello, Session, digest
from dht.net.wire import FRAME_HEADER, FRAME_MSG, MessageLimits, pack, unpack
from tests.helpers.child import JsonLinesChild

WORKER = Path(__file__).with_name("net_worker.py")
# What a crashed task or handler leaves in a log; an honest node must never show them.
CRASH_MARKERS = ("Traceback", "Task exception was never retrieved", "UNHANDLED")
# a 500 in an error's text, not three digits inside a hex peer id or digest next to it
_STATUS_500 = re.compile(r"(?<![0-9a-f])500(?![0-9a-f])")


def is_status_500(error: BaseException) -> bool:
    """Whether an error's text names an HTTP 500 (a server that crashed, not one that refused)."""
    return _STATUS_500.search(str(error)) is not None


@dataclass
class Answer:
    """What a node answered to one raw request."""

    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def reason(self) -> str:
        return self.headers.get("x-vp-error", "")

    def message(self) -> Any:
        return unpack(self.body, MessageLimits())


class WireClient:
    """An attacker's client: a real identity, the real wire format, no good manners.

    Args:
        identity: the key it proves (a fresh one by default).
        swarm_key: the swarm key it knows, if any.
        local_host: the source address to connect from (another loopback address, say
            ``127.0.0.2``, so that per-address caps can tell it from honest peers).
    """

    def __init__(
        self,
        identity: PeerIdentity | None = None,
        *,
        swarm_key: bytes | None = None,
        local_host: str | None = None,
    ):
        self.identity = identity or PeerIdentity.generate()
        self.swarm_key = swarm_key
        self._local_host = local_host
        self.http: aiohttp.ClientSession | None = None

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    async def __aenter__(self) -> WireClient:
        local = (self._local_host, 0) if self._local_host else None
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, local_addr=local, force_close=False),
            timeout=aiohttp.ClientTimeout(total=30),
            auto_decompress=False,
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.http.close()

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> Answer:
        async with self.http.post(url, data=body, headers=headers) as resp:
            return Answer(resp.status, dict(resp.headers), await resp.read())

    async def hello(self, address: str) -> Session:
        """Make a session with the node at ``address`` (as an honest peer would)."""
        pending = PendingHello(self.identity)
        body = pack(pending.request.to_wire())
        headers = {"content-type": "application/msgpack"}
        if self.swarm_key:
            headers["x-vp-mac"] = SwarmAuth(self.swarm_key).hello_mac(body)
        answer = await self.post(address + HELLO_PATH, body, headers)
        if answer.status != 200:
            raise AssertionError(f"hello refused: {answer.status} {answer.reason}")
        return pending.finish(answer.message(), swarm_key=self.swarm_key)

    def sign(self, session: Session, path: str, signed_body: bytes) -> dict[str, str]:
        """Headers proving a request whose body (or stream header frame) is ``signed_body``."""
        return signed_headers(session, self.peer_id, "POST", path, digest(signed_body))

    async def rpc(
        self,
        address: str,
        name: str,
        body: bytes,
        *,
        session: Session | None = None,
        signed_body: bytes | None = None,
        extra_headers: dict[str, str] | None = None,
    ) -> Answer:
        """POST ``body`` to RPC ``name``; the MAC covers ``signed_body`` (default ``body``)."""
        session = session or await self.hello(address)
        path = f"/v2/rpc/{name}"
        headers = self.sign(session, path, body if signed_body is None else signed_body)
        headers.update(extra_headers or {})
        return await self.post(address + path, body, headers)

    async def stream(
        self, address: str, name: str, raw_body: bytes, *, header: Any = None
    ) -> Answer:
        """POST a stream whose MAC covers ``header`` and whose body is ``raw_body``."""
        session = await self.hello(address)
        path = f"/v2/stream/{name}"
        headers = self.sign(session, path, pack(header))
        return await self.post(address + path, raw_body, headers)


def header_frame(message: Any) -> bytes:
    """A stream's first frame (no tag: the swarm has no key)."""
    payload = pack(message)
    return FRAME_HEADER.pack(FRAME_MSG, len(payload)) + payload


async def raw_http(host: str, port: int, request: bytes, *, read_timeout_s: float = 15.0) -> bytes:
    """Send raw bytes on a fresh TCP connection; what came back before the node closed it (or
    the timeout passed)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request)
        await writer.drain()
        async with asyncio.timeout(read_timeout_s):
            return await reader.read(65536)
    except TimeoutError:
        return b""
    finally:
        writer.close()


class NodeProcess(JsonLinesChild):
    """An honest DHT node in its own process.

    Args:
        spec: ``initial_peers``, ``transport`` and ``dht`` (config field overrides).
        log_path: where the worker's log goes.
    """

    name = "node process"

    def __init__(self, spec: dict[str, Any], log_path: Path):
        self.log_path = log_path
        self._log = open(log_path, "w")
        super().__init__(WORKER, spec, stderr=self._log)
        self._lock = asyncio.Lock()

    def exit_detail(self) -> str:
        return f": {self.log()}"

    async def ask(self, command: dict[str, Any], timeout_s: float = 60.0) -> dict[str, Any]:
        """Send one command (``info``, ``store``, ``get``, ``ping``, ``lookup``); its answer."""
        async with self._lock:
            self.send(command)
            return await self.receive(timeout_s)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def crashes(self) -> list[str]:
        """Lines of the log that show an exception escaping (there must be none)."""
        return [line for line in self.log().splitlines() if any(m in line for m in CRASH_MARKERS)]

    def kill(self) -> None:
        super().kill()
        self._log.close()


ATTACKER_HOST = "127.0.0.2"  # another loopback address: per-address caps tell it from the honest


@pytest.fixture
async def node_processes(tmp_path):
    """Factory: ``await node_processes(count, **spec)`` starts honest nodes in processes (the
    first alone, the others bootstrapping from it); all are killed at teardown."""
    started: list[NodeProcess] = []

    async def start(count: int, **spec: Any) -> list[NodeProcess]:
        nodes: list[NodeProcess] = []
        for _ in range(count):
            initial = [nodes[0].address] if nodes else spec.get("initial_peers", [])
            log = tmp_path / f"node{len(started)}.log"
            node = NodeProcess({**spec, "initial_peers": initial}, log)
            started.append(node)
            nodes.append(await node.started())
        return nodes

    yield start
    for node in started:
        node.kill()


async def assert_serving(nodes: list[NodeProcess], key: str) -> None:
    """The honest nodes still store and find: a signed record written by the first node is
    read back, exactly, by the last."""
    stored = await nodes[0].ask({"cmd": "store", "key": key, "value": [key, 1], "signed": True})
    assert stored["ok"], stored
    found = await nodes[-1].ask({"cmd": "get", "key": key, "latest": True})
    assert found["value"] == {f"peer:{nodes[0].peer_id}": [key, 1]}, found


def assert_no_crashes(nodes: list[NodeProcess]) -> None:
    for node in nodes:
        assert node.process.poll() is None, f"node exited: {node.log()[-2000:]}"
        assert node.crashes() == [], node.crashes()


async def info_when(node: NodeProcess, condition, *, polls: int = 200) -> dict[str, Any]:
    """The node's ``info`` once ``condition(info)`` holds (polled every 50 ms); the last info
    otherwise, for the test's assertion to show."""
    for _ in range(polls):
        info = await node.ask({"cmd": "info"})
        if condition(info):
            return info
        await asyncio.sleep(0.05)
    return info


def http_request(
    path: str, headers: dict[str, str], body: bytes = b"", *, content_length: int | None = None
) -> bytes:
    """A raw HTTP/1.1 POST whose ``Content-Length`` may lie (default: the body's length)."""
    length = len(body) if content_length is None else content_length
    lines = [f"POST {path} HTTP/1.1", "Host: node", f"Content-Length: {length}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def status_line(response: bytes) -> int:
    """The status code of a raw HTTP response (0 if the node sent nothing)."""
    if not response.startswith((b"HTTP/1.1 ", b"HTTP/1.0 ")):
        return 0
    return int(response[9:12])


def host_port(address: str) -> tuple[str, int]:
    host, port = address.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


Outcome = TypeVar("Outcome")


def refused(answer: Answer) -> bool:
    """Whether an answer is a refusal for a share (429)."""
    return answer.status == 429


class Flood(Generic[Outcome]):
    """``num_senders`` tasks calling ``send(sender_index)`` back to back until stopped; every
    outcome kept (an :class:`Answer`, a status...). ``is_refusal`` says which outcomes are the
    node's refusals (the attacker spent its share)."""

    def __init__(
        self,
        send: Callable[[int], Awaitable[Outcome]],
        *,
        is_refusal: Callable[[Outcome], bool],
        num_senders: int = 12,
    ):
        self.send, self.is_refusal, self.num_senders = send, is_refusal, num_senders
        self.outcomes: list[Outcome] = []
        self._refused = asyncio.Event()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.started_s = self.stopped_s = 0.0

    def start(self) -> None:
        self.started_s = time.monotonic()
        self._tasks = [asyncio.create_task(self._run(i)) for i in range(self.num_senders)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        self.stopped_s = time.monotonic()

    async def _run(self, index: int) -> None:
        while not self._stop.is_set():
            outcome = await self.send(index)
            self.outcomes.append(outcome)
            if self.is_refusal(outcome):
                self._refused.set()

    async def until_refused(self, timeout_s: float = 30.0, *, required: bool = True) -> None:
        """Wait until the attacker spent its share (its first refusal), at most ``timeout_s``
        (past it: TimeoutError, or just go on where a refusal is not ``required``)."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._refused.wait()
        except TimeoutError:
            if required:
                raise

    def counts(self, key: Callable[[Outcome], Any] = lambda outcome: outcome) -> Counter:
        return Counter(map(key, self.outcomes))

    @property
    def duration_s(self) -> float:
        return self.stopped_s - self.started_s
