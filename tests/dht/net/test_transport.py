"""The aiohttp transport between real servers on loopback."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import time

import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from dht.errors import (
    BusyError,
    ConfigError,
    RemoteError,
    RequestTimeoutError,
    TransportError,
    WrongPeerError,
)
from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.net.config import TransportConfig
from dht.net.session_issuer import SessionIssuer
from dht.net.wire import MessageLimits

pytestmark = pytest.mark.timeout(60)
KEY = b"swarm-key-for-tests-0123456789"


async def echo(ctx, payload):
    return {"payload": payload, "sender": ctx.sender}


async def halve(stream):
    """Full duplex: reply to each chunk as it arrives (float32 values halved)."""
    await stream.reply({"numel": stream.header["numel"]})
    buffer = bytearray(4 << 20)
    while (num_bytes := await stream.recv_into(memoryview(buffer))) is not None:
        values = np.frombuffer(buffer, dtype=np.float32, count=num_bytes // 4) * 0.5
        await stream.send(values)


async def roundtrip(client, server, values: np.ndarray, chunk_bytes: int = 1 << 20) -> np.ndarray:
    view = memoryview(values).cast("B")
    out = np.empty_like(values)
    out_view = memoryview(out).cast("B")
    async with client.open_stream(server.address, "halve", {"numel": values.size}) as stream:

        async def send_all():
            for start in range(0, len(view), chunk_bytes):
                await stream.send(view[start : start + chunk_bytes])
            await stream.finish_sending()

        sender = asyncio.create_task(send_all())
        assert await stream.reply_header() == {"numel": values.size}
        filled = 0
        while (num_bytes := await stream.recv_into(out_view[filled:])) is not None:
            filled += num_bytes
        await sender
    assert filled == len(view)
    return out


@pytest.mark.parametrize("swarm_key", [None, KEY])
async def test_rpc_roundtrip_and_counters(make_transport, swarm_key):
    config = TransportConfig(swarm_key=swarm_key)
    server = await make_transport(config, rpc={"echo": echo})
    client = await make_transport(config)
    payload = {"a": [1, 2.5, None, True], "b": b"\x00\xff" * 10, "s": "ü"}
    answer = await client.call(server.address, "echo", payload)
    assert answer == {"payload": payload, "sender": client.peer_id}
    assert client.counters.sent == server.counters.recv > 0
    assert client.counters.recv == server.counters.sent > 0
    assert set(client.counters.per_peer) == {server.peer_id}
    assert set(server.counters.per_peer) == {client.peer_id}
    # per RPC name, both sides: what a benchmark tells the DHT's bytes apart by
    for side in (client, server):
        assert set(side.counters.per_rpc) == {"echo"}
        assert side.counters.per_rpc["echo"].sent == side.counters.sent
        assert side.counters.per_rpc["echo"].recv == side.counters.recv


@pytest.mark.parametrize("swarm_key", [None, KEY])
async def test_stream_full_duplex_is_exact(make_transport, swarm_key):
    config = TransportConfig(swarm_key=swarm_key)
    server = await make_transport(config, streams={"halve": halve})
    client = await make_transport(config)
    values = np.random.default_rng(0).standard_normal(3_000_001).astype(np.float32)
    out = await roundtrip(client, server, values)
    np.testing.assert_array_equal(out, values * np.float32(0.5))
    assert server.counters.per_peer[client.peer_id].recv == values.nbytes
    assert client.counters.per_peer[server.peer_id].recv == values.nbytes


async def where_from(ctx, payload):
    return ctx.remote_host


async def test_source_host_is_the_address_others_see(make_transport):
    """Two nodes on one host, each with an address of its own (``peer bench swarm``'s peers):
    the server's limits per address charge each to its own, not both to 127.0.0.1."""
    server = await make_transport(TransportConfig(host="127.1.0.1"), rpc={"from": where_from})
    pinned = await make_transport(TransportConfig(host="127.1.0.2", source_host="127.1.0.2"))
    unpinned = await make_transport(TransportConfig(host="127.1.0.3"))
    assert await pinned.call(server.address, "from", None) == "127.1.0.2"
    # without it the operating system picks the source: loopback's own address
    assert await unpinned.call(server.address, "from", None) == "127.0.0.1"


def test_a_source_host_that_is_no_address_is_refused_by_name():
    with pytest.raises(ConfigError, match="source_host must be an IP address, got 'lo'"):
        TransportConfig(source_host="lo")


async def test_client_mode_calls_but_serves_nothing(make_transport):
    server = await make_transport(rpc={"echo": echo})
    client = await make_transport(TransportConfig(client_mode=True))
    assert client.address is None
    assert (await client.call(server.address, "echo", 7))["payload"] == 7


async def test_stream_chunk_over_limit_is_refused_and_node_serves_on(make_transport):
    limits = MessageLimits(max_chunk_bytes=1 << 16)
    server = await make_transport(
        TransportConfig(limits=limits), streams={"halve": halve}, rpc={"echo": echo}
    )
    client = await make_transport()
    with pytest.raises((RemoteError, TransportError)):
        await roundtrip(client, server, np.ones(1 << 16, np.float32), chunk_bytes=1 << 18)
    assert (await client.call(server.address, "echo", 1))["payload"] == 1
    out = await roundtrip(client, server, np.ones(1000, np.float32), chunk_bytes=1 << 12)
    assert out.tolist() == [0.5] * 1000


async def test_handler_refusal_before_reply_is_a_4xx_with_reason(make_transport):
    async def busy(stream):
        raise BusyError("come back later")

    server = await make_transport(streams={"busy": busy})
    client = await make_transport()
    async with client.open_stream(server.address, "busy", {}) as stream:
        with pytest.raises(RemoteError) as info:
            await stream.reply_header()
    assert info.value.status == 429 and "come back later" in info.value.reason


async def test_concurrent_streams_per_sender_are_bounded(make_transport):
    release = asyncio.Event()

    async def hold(stream):
        await stream.reply({})
        await release.wait()

    server = await make_transport(TransportConfig(max_streams_per_peer=2), streams={"hold": hold})
    client = await make_transport()
    async with (
        client.open_stream(server.address, "hold", {}) as first,
        client.open_stream(server.address, "hold", {}) as second,
    ):
        await first.reply_header()
        await second.reply_header()
        async with client.open_stream(server.address, "hold", {}) as third:
            with pytest.raises(RemoteError) as info:
                await third.reply_header()
        assert info.value.status == 429
        release.set()
    other = await make_transport()  # another sender is not affected by the first one's streams
    async with other.open_stream(server.address, "hold", {}) as stream:
        assert await stream.reply_header() == {}


async def test_timeouts_are_typed(make_transport):
    async def slow(ctx, payload):
        await asyncio.sleep(5)

    server = await make_transport(rpc={"slow": slow})
    client = await make_transport()
    with pytest.raises(RequestTimeoutError):
        await client.call(server.address, "slow", None, timeout_s=0.2)
    with pytest.raises(TransportError):
        await client.call("http://127.0.0.1:9", "slow", None)


def _self_signed(tmp_path):
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_file), str(key_file)


async def test_tls(make_transport, tmp_path):
    cert, key = _self_signed(tmp_path)
    server = await make_transport(
        TransportConfig(tls_cert_file=cert, tls_key_file=key),
        rpc={"echo": echo},
        streams={"halve": halve},
    )
    assert server.address.startswith("https://127.0.0.1:")
    client = await make_transport(TransportConfig(tls_ca_file=cert))
    assert (await client.call(server.address, "echo", "hi"))["payload"] == "hi"
    out = await roundtrip(client, server, np.arange(100_000, dtype=np.float32))
    np.testing.assert_array_equal(out, np.arange(100_000, dtype=np.float32) * 0.5)
    untrusting = await make_transport()  # system CAs only: the self-signed cert is refused
    with pytest.raises(TransportError):
        await untrusting.call(server.address, "echo", "hi")


async def test_the_answering_peer_is_proven_and_another_than_expected_is_refused(make_transport):
    calls = []

    async def record(ctx, payload):
        calls.append(ctx.sender)
        return payload

    server = await make_transport(rpc={"record": record}, streams={"halve": halve})
    other = await make_transport()
    client = await make_transport()
    assert await client.call(server.address, "record", 1, expected_peer=server.peer_id) == 1
    assert client.peer_at(server.address) == server.peer_id
    with pytest.raises(WrongPeerError) as info:
        await client.call(server.address, "record", 2, expected_peer=other.peer_id)
    assert (info.value.expected, info.value.actual) == (other.peer_id, server.peer_id)
    with pytest.raises(WrongPeerError):
        async with client.open_stream(
            server.address, "halve", {"numel": 1}, expected_peer=other.peer_id
        ):
            pass
    assert calls == [client.peer_id]  # refused before anything was sent


async def test_a_node_that_forgot_its_sessions_gets_a_new_one_transparently(make_transport):
    server = await make_transport(rpc={"echo": echo})
    client = await make_transport()
    assert (await client.call(server.address, "echo", 1))["payload"] == 1
    # the node restarts: its ticket key is new, the client's session unknown to it
    server.server.issuer = SessionIssuer(server.identity, swarm_key=None, lifetime_s=60.0)
    assert (await client.call(server.address, "echo", 2))["payload"] == 2
    assert client.sessions.num_handshakes == 2


async def test_peers_whose_clocks_disagree_still_talk(tmp_path, monkeypatch):
    # The node runs in its own process with the true clock; this process's clock is 10 minutes
    # behind. Requests are stamped with the node's clock (learnt in the handshake), so the
    # replay window (30 s) holds without asking volunteers to run NTP.
    from tests.adversarial.harness_net import NodeProcess

    node = await NodeProcess({}, tmp_path / "node.log").started()
    try:
        real_time = time.time
        monkeypatch.setattr(time, "time", lambda: real_time() - 600.0)
        async with HttpTransport(PeerIdentity.generate(), TransportConfig()) as skewed:
            answer = await skewed.call(node.address, "dht.ping", {"addr": None})
            assert answer["peer_id"] == node.peer_id
            assert await skewed.call(node.address, "dht.ping", {"addr": None})
    finally:
        node.kill()
