"""Property tests: signed malformed input on every route, direct and through a relay tunnel.

The fuzzer proves its identity first (a real handshake, every request signed under its session),
so what it sends reaches the code behind authentication: the DHT's RPCs (``dht.ping``,
``dht.find``, ``dht.store``), ``dial_back``, an echo RPC, the handshake itself (separate, and
riding on a first RPC in ``x-vp-hello``), and two stream
handlers (one that reads chunks, one that reads them into a buffer), each at a node that serves
directly and at one reached only through a relay. Hypothesis makes the bodies (raw bytes,
arbitrary msgpack, near-valid messages with one field wrong), the headers (one signed header
replaced by arbitrary bytes, sent raw) and the stream frames (kinds, lengths and payloads).

Each malformed input must be answered with a 4xx and a reason, within the route's own timeout;
no 5xx, and nothing in the logs at ERROR or with a traceback; and after each example an honest
peer's call through the same path succeeds (the node keeps serving).

The servers run on an event loop in a thread of their own (Hypothesis drives plain functions).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import os
import threading
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dht.config import DHTConfig
from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.kademlia.node import DHTNode
from dht.net.client import HELLO_HEADER, HELLO_PATH
from dht.net.config import ReachabilityConfig, TransportConfig
from dht.net.session import FirstRequest, PendingHello, Session, digest
from dht.net.wire import FRAME_BIN, FRAME_ERROR, FRAME_HEADER, FRAME_MSG, pack
from tests.adversarial.harness_net import WireClient, header_frame, http_request

pytestmark = pytest.mark.timeout(120)
VIAS = ("direct", "relayed")
RPCS = ("dht.ping", "dht.find", "dht.store", "dial_back", "echo")
STREAMS = ("fuzz.sink", "fuzz.into")
# Short timeouts, so "at once" can be told from "after the route's timeout" in a test's time.
CONFIG = TransportConfig(
    request_timeout_s=4.0,
    body_stall_timeout_s=1.0,
    stream_idle_timeout_s=2.0,
    stream_write_timeout_s=2.0,
    reachability=ReachabilityConfig(dial_back_timeout_s=1.0, check_timeout_s=2.0),
)
ANSWER_WITHIN_S = CONFIG.request_timeout_s + 2.0  # the route's timeout, and a loaded machine's
# The relay waits for the relayed peer's answer up to its stream idle timeout, then answers 502:
# at 2 s a loaded machine's late (but immediate) answer of the relayed peer became a 502 in a
# full run. The relay outlasts the relayed peer's own wait for its server (1.5 times the
# request timeout), so a late answer arrives with its reason; the nodes keep the short timeouts.
RELAY_CONFIG = dataclasses.replace(CONFIG, stream_idle_timeout_s=2 * ANSWER_WITHIN_S)
SETTINGS = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


async def echo(ctx, payload):
    return payload


async def sink(stream) -> None:
    """Reads every chunk, then answers how many bytes came (nothing is replied before)."""
    num_bytes = 0
    while (chunk := await stream.recv()) is not None:
        num_bytes += len(chunk)
    await stream.reply({"bytes": num_bytes})


async def sink_into(stream) -> None:
    buffer = memoryview(bytearray(4096))
    num_bytes = 0
    while (n := await stream.recv_into(buffer)) is not None:
        num_bytes += n
    await stream.reply({"bytes": num_bytes})


class Trouble(logging.Handler):
    """Keeps every log record at ERROR or above, or with a traceback, from any thread."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR or record.exc_info or "Traceback" in record.getMessage():
            self.records.append(f"{record.name} {record.levelname}: {record.getMessage()[:300]}")


class Lab:
    """Two nodes (one direct, one relayed through a third), a fuzzer and an honest caller, on
    an event loop in a background thread."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(self._unhandled)
        self.unhandled: list[str] = []
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.run(self._start(), 60)

    def _unhandled(self, loop, context: dict[str, Any]) -> None:
        self.unhandled.append(f"{context.get('message')}: {context.get('exception')!r}")

    def run(self, coro, timeout_s: float):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _node(self) -> tuple[HttpTransport, DHTNode]:
        identity = PeerIdentity.generate()
        transport = HttpTransport(identity, CONFIG)
        node = DHTNode(transport=transport, identity=identity, config=DHTConfig())
        transport.add_rpc_handler("echo", echo)
        transport.add_stream_handler("fuzz.sink", sink)
        transport.add_stream_handler("fuzz.into", sink_into)
        await transport.start()
        await node.start()
        self._closing += [node, transport]
        return transport, node

    async def _start(self) -> None:
        self._closing: list[Any] = []
        direct, _ = await self._node()
        self.relay = HttpTransport(PeerIdentity.generate(), RELAY_CONFIG)
        await self.relay.start()
        self._closing.append(self.relay)
        hidden, _ = await self._node()
        relayed = await hidden.attach_relay([self.relay.address])
        self.addresses = {"direct": direct.address, "relayed": relayed}
        self.honest = HttpTransport(PeerIdentity.generate(), TransportConfig(client_mode=True))
        await self.honest.start()
        self._closing.append(self.honest)
        self.fuzzer = await WireClient().__aenter__()
        self.sessions: dict[str, Session] = {
            via: await self.fuzzer.hello(address) for via, address in self.addresses.items()
        }

    async def _close(self) -> None:
        await self.fuzzer.__aexit__()
        for closable in self._closing:
            await closable.close()

    def close(self) -> None:
        self.run(self._close(), 60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def still_serves(self, via: str) -> None:
        """An honest peer's call along the same path succeeds."""
        answer = self.run(self.honest.call(self.addresses[via], "echo", [via], timeout_s=5), 10)
        assert answer == [via]

    # ---- what the fuzzer sends ---------------------------------------------------------------

    async def post_signed(self, via: str, path: str, body: bytes, signed_body: bytes) -> tuple:
        """POST ``body`` to ``path`` at ``via``'s node, the MAC over ``signed_body``: (status,
        reason, seconds)."""
        headers = self.fuzzer.sign(self.sessions[via], path, signed_body)
        answer = await self.fuzzer.post(self.addresses[via] + path, body, headers)
        return answer.status, answer.reason or answer.body.decode(errors="replace"), answer

    async def post_raw(self, via: str, path: str, request_bytes: bytes) -> tuple[int, bytes]:
        """Send one raw HTTP request to ``via``'s node (or its relay): the status and what came
        back (0 if the connection closed with no answer)."""
        address = self.addresses[via]
        host_port, _, prefix = address.removeprefix("http://").partition("/")
        host, port = host_port.rsplit(":", 1)
        full_path = ("/" + prefix if prefix else "") + path
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(
                request_bytes.replace(b"POST " + path.encode(), b"POST " + full_path.encode(), 1)
            )
            await writer.drain()
            data = await reader.read(65536)
        finally:
            writer.close()
        if not data.startswith((b"HTTP/1.1 ", b"HTTP/1.0 ")):
            return 0, data
        return int(data[9:12]), data


@pytest.fixture(scope="module")
def lab():
    trouble = Trouble()
    logging.getLogger().addHandler(trouble)
    lab = Lab()
    lab.trouble = trouble
    yield lab
    lab.close()
    logging.getLogger().removeHandler(trouble)


def check_answer(lab: Lab, status: int, reason: str, elapsed_s: float, what: Any) -> None:
    trouble, lab.trouble.records = lab.trouble.records, []  # the next example starts clean
    assert trouble == [], (trouble, what)
    assert status < 500, (status, reason, what)
    assert elapsed_s < ANSWER_WITHIN_S, (elapsed_s, status, what)
    if status >= 400:
        assert reason, (status, what)
    assert lab.unhandled == [], lab.unhandled


# ---- strategies ------------------------------------------------------------------------------

# what msgpack can pack: a larger int fails in the fuzzer's own packing, not at the server
wire_ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    wire_ints,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=80),
    st.binary(max_size=80),
)
msgpack_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=6),
        st.dictionaries(
            st.one_of(st.text(max_size=12), st.binary(max_size=24), st.integers(0, 9)),
            children,
            max_size=6,
        ),
    ),
    max_leaves=24,
)
peer_ids = st.one_of(st.just("ab" * 32), st.text(max_size=70), st.binary(max_size=40))
ids20 = st.one_of(st.binary(min_size=20, max_size=20), st.binary(max_size=40), msgpack_values)
addresses = st.one_of(
    st.none(), st.just("http://127.0.0.1:9"), st.text(max_size=60), msgpack_values
)
records = st.lists(
    st.lists(msgpack_values, max_size=6)
    | st.tuples(ids20, st.one_of(st.text(max_size=70), st.binary(max_size=40), wire_ints),
                st.binary(max_size=64), st.floats(), st.binary(min_size=64, max_size=64)).map(list),
    max_size=4,
)  # fmt: skip


def near_valid(route: str) -> st.SearchStrategy[dict]:
    """A message of ``route``'s shape with arbitrary values (and sometimes an extra field)."""
    shapes = {
        "dht.ping": {"addr": addresses},
        "dht.find": {"addr": addresses, "key": ids20, "value": msgpack_values},
        "dht.store": {"addr": addresses, "records": records},
        "dial_back": {"port": st.integers(-5, 70000) | msgpack_values, "tls": msgpack_values},
        "echo": {"x": msgpack_values},
    }
    fields = st.fixed_dictionaries(shapes[route])
    extra = st.dictionaries(st.text(max_size=8), msgpack_values, max_size=2)
    return st.builds(lambda a, b: {**b, **a}, fields, extra)


def rpc_bodies(route: str) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=300),
        msgpack_values.map(pack),
        near_valid(route).map(pack),
    )


@st.composite
def routes_and_bodies(draw):
    route = draw(st.sampled_from(RPCS))
    return draw(st.sampled_from(VIAS)), route, draw(rpc_bodies(route))


# ---- RPC bodies ------------------------------------------------------------------------------


@SETTINGS
@given(case=routes_and_bodies())
def test_signed_rpc_bodies_are_answered_at_once(lab, case):
    via, route, body = case
    start = time.monotonic()
    status, reason, _ = lab.run(lab.post_signed(via, f"/v2/rpc/{route}", body, body), 30)
    check_answer(lab, status, reason, time.monotonic() - start, (via, route, body[:200]))
    lab.still_serves(via)


@st.composite
def hellos(draw):
    """A hello that proves nothing: arbitrary bytes or msgpack, or a real hello's fields
    with one of them replaced."""
    kind = draw(st.sampled_from(["bytes", "msgpack", "field"]))
    if kind == "bytes":
        return draw(st.binary(max_size=600))
    if kind == "msgpack":
        return pack(draw(msgpack_values))
    wire = PendingHello(PeerIdentity.generate()).request.to_wire()
    name = draw(st.sampled_from(sorted(wire)))
    wire[name] = draw(msgpack_values | peer_ids)
    return pack(wire)


@SETTINGS
@given(via=st.sampled_from(VIAS), body=hellos())
def test_malformed_hellos_are_answered_at_once(lab, via, body):
    start = time.monotonic()
    headers = {"content-type": "application/msgpack"}
    answer = lab.run(lab.fuzzer.post(lab.addresses[via] + HELLO_PATH, body, headers), 30)
    reason = answer.reason or answer.body.decode(errors="replace")
    # (a 200 is fine: a field replaced by a value as good, a version of 2, say)
    check_answer(lab, answer.status, reason, time.monotonic() - start, (via, body[:200]))
    lab.still_serves(via)


@st.composite
def first_hellos(draw, to: str, path: str, body: bytes) -> str:
    """An ``x-vp-hello`` header that proves nothing: base64 of arbitrary bytes or msgpack, or a
    real first-request hello's fields with one of them replaced, or printable junk."""
    kind = draw(st.sampled_from(["bytes", "msgpack", "field", "text"]))
    if kind == "text":
        return draw(st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=200))
    if kind == "bytes":
        raw = draw(st.binary(max_size=600))
    elif kind == "msgpack":
        raw = pack(draw(msgpack_values))
    else:
        first = FirstRequest(to, "POST", path, digest(body))
        wire = PendingHello(PeerIdentity.generate(), first).request.to_wire()
        name = draw(st.sampled_from(sorted(wire)))
        wire[name] = draw(msgpack_values | peer_ids)
        raw = pack(wire)
    return base64.urlsafe_b64encode(raw).decode("ascii")


@SETTINGS
@given(via=st.sampled_from(VIAS), route=st.sampled_from(RPCS), data=st.data())
def test_first_requests_with_malformed_hellos_are_answered_at_once(lab, via, route, data):
    path, body = f"/v2/rpc/{route}", pack({})
    wire = data.draw(first_hellos(lab.sessions[via].peer_id, path, body))
    headers = {
        "content-type": "application/msgpack",
        "x-vp-digest": digest(body).hex(),
        HELLO_HEADER: wire,
    }
    start = time.monotonic()
    answer = lab.run(lab.fuzzer.post(lab.addresses[via] + path, body, headers), 30)
    reason = answer.reason or answer.body.decode(errors="replace")
    # (a 200 is fine: a field replaced by a value as good, a version of 2, say)
    check_answer(lab, answer.status, reason, time.monotonic() - start, (via, route, wire[:200]))
    lab.still_serves(via)


# ---- headers ---------------------------------------------------------------------------------

SIGNED_HEADERS = ("x-vp-peer", "x-vp-ticket", "x-vp-ts", "x-vp-nonce", "x-vp-digest", "x-vp-mac")
header_bytes = st.binary(max_size=120).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))


@SETTINGS
@given(
    via=st.sampled_from(VIAS),
    route=st.sampled_from(RPCS + STREAMS),
    name=st.sampled_from((*SIGNED_HEADERS, "content-type", "transfer-encoding", "x-vp-tunnel")),
    value=header_bytes,
)
def test_signed_requests_with_a_header_replaced_are_answered_at_once(lab, via, route, name, value):
    kind = "stream" if route in STREAMS else "rpc"
    path = f"/v2/{kind}/{route}"
    body = header_frame({"x": 1}) if kind == "stream" else pack({})
    signed = pack({"x": 1}) if kind == "stream" else body
    headers = lab.fuzzer.sign(lab.sessions[via], path, signed)
    headers.pop(name, None)
    raw = http_request(path, headers, body).replace(
        b"\r\n\r\n", b"\r\n" + name.encode() + b": " + value + b"\r\n\r\n", 1
    )
    start = time.monotonic()
    status, answer = lab.run(lab.post_raw(via, path, raw), 30)
    elapsed_s = time.monotonic() - start
    assert status != 0, (via, route, name, value, answer[:300])
    head = answer.split(b"\r\n\r\n", 1)[0]
    reason = answer.split(b"\r\n\r\n", 1)[-1].decode(errors="replace") if status >= 400 else ""
    assert all(32 <= byte < 127 for line in head.split(b"\r\n") for byte in line), head
    check_answer(lab, status, reason, elapsed_s, (via, route, name, value))
    lab.still_serves(via)


# ---- stream frames ---------------------------------------------------------------------------

frames = st.tuples(
    st.sampled_from([FRAME_BIN, FRAME_BIN, FRAME_MSG, FRAME_ERROR, 0, 4, 255]),
    st.sampled_from(["exact", "exact", "short", "long", "huge"]),
    st.binary(max_size=5000),
)


def declared_length(length: str, payload: bytes) -> int:
    return {
        "exact": len(payload),
        "short": max(0, len(payload) - 1),
        "long": len(payload) + 7,
        "huge": 2**32 - 1,
    }[length]


def frame_bytes(kind: int, length: str, payload: bytes) -> bytes:
    return FRAME_HEADER.pack(kind, declared_length(length, payload)) + payload


@SETTINGS
@given(
    via=st.sampled_from(VIAS),
    route=st.sampled_from(STREAMS),
    header=msgpack_values,
    body_frames=st.lists(frames, max_size=5),
    tail=st.binary(max_size=8),
)
def test_signed_streams_with_malformed_frames_are_answered_at_once(
    lab, via, route, header, body_frames, tail
):
    body = header_frame(header) + b"".join(frame_bytes(*f) for f in body_frames) + tail
    well_formed = not tail and all(
        k == FRAME_BIN and declared_length(n, p) == len(p) for k, n, p in body_frames
    )
    start = time.monotonic()
    path = f"/v2/stream/{route}"
    status, reason, _answer = lab.run(lab.post_signed(via, path, body, pack(header)), 30)
    check_answer(lab, status, reason, time.monotonic() - start, (via, route, body[:200]))
    if well_formed and (route == "fuzz.sink" or all(len(p) <= 4096 for *_, p in body_frames)):
        assert status == 200, (status, reason)
    elif not well_formed:
        assert 400 <= status < 500, (status, reason, body[:200])
    lab.still_serves(via)


def test_the_fuzzer_reaches_behind_authentication(lab):
    """A well-formed signed request of the fuzzer is served (so the refusals above are the
    handlers' and the frame readers', not the authentication's)."""
    for via in VIAS:
        body = pack({"x": os.urandom(4)})
        status, _, answer = lab.run(lab.post_signed(via, "/v2/rpc/echo", body, body), 10)
        assert status == 200 and answer.body == body
