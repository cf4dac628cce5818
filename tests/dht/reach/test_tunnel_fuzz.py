"""Property tests: a relayed end that answers forwarded requests with malformed tunnel frames.

The fuzzer proves its identity to a real relay and attaches itself (the signed WebSocket attach
an honest relayed peer makes). A caller then sends a request to the fuzzer's relayed address;
the relay opens a stream in the tunnel, and the fuzzer answers with what Hypothesis draws: DATA
or END before HEAD, HEAD twice, a HEAD or RESET whose payload is not a map (or not msgpack),
frames of unknown kinds, for other streams, shorter than their prefix, larger than the tunnel
accepts, text instead of binary. Whatever it sends, the caller's answer comes at once (within
the route's own timeout) and, unless a well-formed HEAD went first (then the answer's status is
the fuzzer's own, and a protocol error afterwards can only cut the answer short), it is a 4xx or
a 502 with a reason; nothing is logged at ERROR or with a traceback, no task fails unseen, and
the relay keeps serving (an honest relayed peer's call through it succeeds after each example).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import threading
import time
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.net.client import signed_headers
from dht.net.config import TransportConfig
from dht.net.session import digest
from dht.net.wire import pack
from dht.reach.relay_mux import CREDIT, DATA, END, HEAD, MAX_MESSAGE_BYTES, OPEN, RESET
from dht.reach.relay_server import ATTACH_PATH
from tests.adversarial.harness_net import WireClient
from tests.dht.net.test_signed_fuzz import Trouble, msgpack_values

pytestmark = pytest.mark.timeout(120)
_PREFIX = struct.Struct("<BI")
CONFIG = TransportConfig(
    request_timeout_s=4.0,
    body_stall_timeout_s=1.0,
    stream_idle_timeout_s=2.0,
    stream_write_timeout_s=2.0,
)
ANSWER_WITHIN_S = CONFIG.stream_idle_timeout_s + 2.0  # the route's timeout, and a loaded machine's
SETTINGS = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


async def echo(ctx, payload):
    return payload


class TunnelLab:
    """A relay, an honest relayed peer, the fuzzer's identity and a plain HTTP caller, on an
    event loop in a background thread (Hypothesis drives plain functions)."""

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

    async def _start(self) -> None:
        self.relay = HttpTransport(PeerIdentity.generate(), CONFIG)
        await self.relay.start()
        self.hidden = HttpTransport(PeerIdentity.generate(), CONFIG)
        self.hidden.add_rpc_handler("echo", echo)
        await self.hidden.start()
        self.hidden_address = await self.hidden.attach_relay([self.relay.address])
        self.honest = HttpTransport(PeerIdentity.generate(), TransportConfig(client_mode=True))
        await self.honest.start()
        self.fuzzer = await WireClient().__aenter__()
        self.caller = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))

    async def _close(self) -> None:
        await self.caller.close()
        await self.fuzzer.__aexit__()
        for transport in (self.honest, self.hidden, self.relay):
            await transport.close()

    def close(self) -> None:
        self.run(self._close(), 60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def still_serves(self) -> None:
        answer = self.run(self.honest.call(self.hidden_address, "echo", ["ok"], timeout_s=5), 10)
        assert answer == ["ok"]

    async def attach(self) -> aiohttp.ClientWebSocketResponse:
        """The fuzzer's own tunnel to the relay (a signed attach, as an honest peer's)."""
        session = await self.fuzzer.hello(self.relay.address)
        headers = signed_headers(session, self.fuzzer.peer_id, "GET", ATTACH_PATH, digest(b""))
        return await self.fuzzer.http.ws_connect(
            self.relay.address + ATTACH_PATH, headers=headers, max_msg_size=MAX_MESSAGE_BYTES
        )

    async def forwarded(self, messages: list, silent: bool) -> tuple[int, str, str]:
        """A caller's request to the fuzzer's relayed address, answered by ``messages``:
        (status, reason, what else happened); status 0 for an answer cut short."""
        ws = await self.attach()
        url = f"{self.relay.address}/v2/relay/{self.fuzzer.peer_id}/v2/rpc/echo"
        call = asyncio.ensure_future(self.caller.post(url, data=pack(["x"])))
        try:
            async with asyncio.timeout(10):
                opening = await ws.receive()
            kind, stream_id = _PREFIX.unpack_from(opening.data)
            assert kind == OPEN, kind
            for message in messages:
                await _send(ws, stream_id, *message)
            if not silent:  # the end of every example: the stream reset with a proper reason
                await _send(ws, stream_id, "RESET", "this", pack({"reason": "fuzz over"}))
            async with asyncio.timeout(30):
                resp = await call
                try:
                    await resp.read()
                except aiohttp.ClientPayloadError:
                    return 0, "", f"cut after {resp.status}"
                return resp.status, resp.headers.get("x-vp-error", ""), ""
        finally:
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
            await ws.close()


KINDS = {"OPEN": OPEN, "HEAD": HEAD, "DATA": DATA, "END": END, "CREDIT": CREDIT, "RESET": RESET}


async def _send(ws, stream_id: int, kind: str, stream: str, payload: bytes) -> None:
    if kind == "TEXT":
        await ws.send_str(payload.decode("latin-1"))
        return
    if kind == "SHORT":
        await ws.send_bytes(payload[:4])
        return
    number = KINDS.get(kind, 0) if not kind.startswith("KIND") else int(kind[4:])
    target = {"this": stream_id, "other": stream_id + 2, "even": stream_id + 1}[stream]
    await ws.send_bytes(_PREFIX.pack(number, target) + payload)


VALID_HEAD = pack({"s": 200, "h": {"content-type": "application/msgpack"}})
payloads = st.one_of(
    st.just(VALID_HEAD),
    st.just(pack({"reason": "r"})),
    msgpack_values.map(pack),
    st.binary(max_size=64),
    st.just(b"\x00" * (MAX_MESSAGE_BYTES + 16)),  # over what the tunnel accepts
    st.just(pack({"s": 200, "h": {"x": 1}})),
    st.just(pack({"s": "200", "h": {}})),
    st.just(pack({"s": 99, "h": {}})),
    st.just(pack({"s": 200, "h": {"bad\nname": "v"}})),
    st.just(_PREFIX.pack(9, 1)),
)
messages = st.tuples(
    st.sampled_from(
        [*KINDS, "HEAD", "DATA", "END", "RESET", "KIND0", "KIND7", "KIND255", "TEXT", "SHORT"]
    ),
    st.sampled_from(["this", "this", "this", "other", "even"]),
    payloads,
)


@pytest.fixture(scope="module")
def lab():
    trouble = Trouble()
    logging.getLogger().addHandler(trouble)
    lab = TunnelLab()
    lab.trouble = trouble
    yield lab
    lab.close()
    logging.getLogger().removeHandler(trouble)


def _valid_head_first(sequence: list) -> bool:
    """Whether the relay's caller had a well-formed HEAD of its stream before anything else of
    that stream (then its status is the fuzzer's, and a later error can only cut it short)."""
    for kind, stream, payload in sequence:
        if kind in ("TEXT", "SHORT") or (stream == "even" and kind == "OPEN"):
            return False  # the tunnel breaks before anything reaches the caller
        if stream != "this" and kind not in ("HEAD", "DATA", "END", "CREDIT", "RESET"):
            return False
        if stream != "this":
            continue
        if kind == "CREDIT" and len(payload) == 4:
            continue
        return kind == "HEAD" and payload == VALID_HEAD
    return False


@SETTINGS
@given(sequence=st.lists(messages, max_size=5), silent=st.booleans())
def test_a_relayed_end_that_sends_malformed_frames_gets_its_caller_answered_at_once(
    lab, sequence, silent
):
    start = time.monotonic()
    status, reason, note = lab.run(lab.forwarded(sequence, silent), 60)
    elapsed_s = time.monotonic() - start
    trouble, lab.trouble.records = lab.trouble.records, []
    assert trouble == [], (trouble, sequence)
    assert lab.unhandled == [], lab.unhandled
    assert elapsed_s < ANSWER_WITHIN_S, (elapsed_s, status, sequence)
    if not _valid_head_first(sequence):
        assert status == 502 or 400 <= status < 500, (status, reason, note, sequence)
        assert reason, (status, sequence)
    lab.still_serves()


def test_the_fuzzers_tunnel_serves_a_well_formed_answer(lab):
    """A HEAD, a body and END are relayed to the caller as they are (so the refusals above are
    the relay's answers to malformed frames, not a tunnel that never worked)."""
    body = pack(["x"])
    sequence = [("HEAD", "this", VALID_HEAD), ("DATA", "this", body), ("END", "this", b"")]
    status, reason, note = lab.run(lab.forwarded(sequence, silent=True), 30)
    assert (status, reason, note) == (200, "", "")


def test_an_answer_complete_before_its_reset_is_relayed_whole(lab):
    """HEAD, body and END, then a RESET (a relayed peer that answered, say a 429, without
    reading the caller's body): the caller gets the whole answer, even where the RESET reached
    the relay before it read the HEAD."""
    body = pack(["x"])
    sequence = [("HEAD", "this", VALID_HEAD), ("DATA", "this", body), ("END", "this", b"")]
    status, reason, note = lab.run(lab.forwarded(sequence, silent=False), 30)
    assert (status, reason, note) == (200, "", "")
    assert lab.trouble.records == [] and lab.unhandled == []


NAMED = {
    "DATA before HEAD": [("DATA", "this", b"body")],
    "END before HEAD": [("END", "this", b"")],
    "RESET whose payload is not a map": [("RESET", "this", pack([1, 2]))],
    "RESET whose payload is not msgpack": [("RESET", "this", b"\xc1\xff")],
    "HEAD that is not a map": [("HEAD", "this", pack("s"))],
    "HEAD with a bad status": [("HEAD", "this", pack({"s": 101, "h": {}}))],
    "HEAD with a header name that is no token": [
        ("HEAD", "this", pack({"s": 200, "h": {"x-vp-bad\nname": "v"}}))
    ],
    "a frame over the tunnel's size": [("DATA", "this", b"\x00" * (MAX_MESSAGE_BYTES + 16))],
    "a frame shorter than its prefix": [("SHORT", "this", b"\x02")],
    "a frame of an unknown kind": [("KIND7", "this", b"")],
    "a text message": [("TEXT", "this", b"hello")],
}


@pytest.mark.parametrize("sequence", list(NAMED.values()), ids=list(NAMED))
def test_each_named_malformed_answer_is_a_502_with_a_reason_at_once(lab, sequence):
    start = time.monotonic()
    status, reason, note = lab.run(lab.forwarded(sequence, silent=True), 30)
    elapsed_s = time.monotonic() - start
    assert lab.trouble.records == [] and lab.unhandled == [], (lab.trouble.records, lab.unhandled)
    assert status == 502 and reason, (status, reason, note)
    assert elapsed_s < ANSWER_WITHIN_S, elapsed_s
    lab.still_serves()


def test_a_second_head_cuts_the_answer_short_at_once(lab):
    """HEAD twice: the caller already has the first HEAD's status; the second can only cut the
    answer (HTTP has no way to take a status back), and at once."""
    start = time.monotonic()
    sequence = [("HEAD", "this", VALID_HEAD), ("HEAD", "this", VALID_HEAD)]
    status, _, note = lab.run(lab.forwarded(sequence, silent=True), 30)
    assert (status, note) == (0, "cut after 200")
    assert time.monotonic() - start < ANSWER_WITHIN_S
    assert lab.trouble.records == [] and lab.unhandled == []
    lab.still_serves()
