"""State sync between real peers on loopback: exact copies, cut downloads retried elsewhere."""

from __future__ import annotations

import asyncio
import dataclasses
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import torch

from dht.config import DHTConfig
from dht.errors import ConfigError
from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.kademlia.node import DHTNode
from dht.net.config import TransportConfig
from dht.tools.faults import Faults, FaultyTransport
from peer.swarm.state_download import download_state, layout_of
from peer.swarm.state_sync import StateServer, StateSnapshot, StateSyncError
from peer.swarm.state_sync_config import StateSyncConfig

pytestmark = pytest.mark.timeout(60)
CONFIG = StateSyncConfig(chunk_bytes=64 * 1024, backoff_s=0.05, announce_interval_s=0.2)


def trained_state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.ReLU(), torch.nn.Linear(300, 7))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 64)).square().mean().backward()
    optimizer.step()
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        for name, value in state.items():
            tensors[f"opt.{index}.{name}"] = value
    tensors["half"] = torch.randn(33, dtype=torch.bfloat16)
    return tensors


@asynccontextmanager
async def peer(initial: list[str], faults: Faults | None = None, config: StateSyncConfig = CONFIG):
    identity = PeerIdentity.generate()
    http = HttpTransport(identity, TransportConfig())
    transport = FaultyTransport(http, faults) if faults else http
    node = DHTNode(transport=transport, identity=identity, config=DHTConfig(initial_peers=initial))
    server = StateServer(transport=transport, dht=node, prefix="run", config=config)
    async with http, node, server:
        yield transport, node, server


async def serve(server: StateServer, snapshot: StateSnapshot) -> None:
    """Hand ``snapshot`` to ``server`` and announce it once its digest is computed."""
    server.update(snapshot)
    await server.settle()
    await server.announce()


async def test_newcomer_gets_an_exact_copy():
    state = trained_state(0)
    async with AsyncExitStack() as stack:
        _, donor_node, donor = await stack.enter_async_context(peer([]))
        await serve(donor, StateSnapshot.capture(3, state, {"epoch": 3, "lr": 0.1}))
        transport, node, _ = await stack.enter_async_context(peer([donor_node.address]))
        got = await download_state(
            transport, node, "run", min_epoch=2, expected=layout_of(state), config=CONFIG
        )
    assert got.epoch == 3 and got.metadata == {"epoch": 3, "lr": 0.1}
    assert got.tensors.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(got.tensors[name], tensor), name


async def test_a_cut_download_is_retried_with_another_donor():
    # two donors, two different states: each is its own donor's word alone
    config = dataclasses.replace(CONFIG, min_agreement=1)
    newest, older = trained_state(1), trained_state(2)
    faults = Faults(cut_streams_after_bytes=100_000)
    async with AsyncExitStack() as stack:
        _, first_node, first = await stack.enter_async_context(peer([]))
        _, _, second = await stack.enter_async_context(peer([first_node.address]))
        await serve(first, StateSnapshot.capture(5, newest))  # the newest: tried first, and cut
        await serve(second, StateSnapshot.capture(4, older))
        faults.cut_streams_to = {first_node.address}
        transport, node, _ = await stack.enter_async_context(peer([first_node.address], faults))
        got = await download_state(
            transport, node, "run", min_epoch=4, expected=layout_of(older), config=config
        )
        assert got.epoch == 4
        assert all(torch.equal(got.tensors[k], v) for k, v in older.items())
        faults.cut_streams_to = None  # every donor cut: a clear failure, nothing half-loaded
        with pytest.raises(StateSyncError, match="every donor failed"):
            await download_state(
                transport, node, "run", min_epoch=4, expected=layout_of(older), config=config
            )


async def test_refuses_a_state_of_another_shape_and_reports_no_donor():
    async with AsyncExitStack() as stack:
        _, donor_node, donor = await stack.enter_async_context(peer([]))
        transport, node, _ = await stack.enter_async_context(peer([donor_node.address]))
        expected = layout_of(trained_state(0))
        with pytest.raises(StateSyncError, match="no peer serves"):
            await download_state(
                transport, node, "run", min_epoch=0, expected=expected, config=CONFIG
            )
        other = trained_state(0)
        other["model.0.weight"] = torch.zeros(10, 10)
        await serve(donor, StateSnapshot.capture(1, other))
        with pytest.raises(StateSyncError, match="unexpected tensor"):
            await download_state(
                transport, node, "run", min_epoch=0, expected=expected, config=CONFIG
            )
        with pytest.raises(StateSyncError, match="no state that recent"):
            await download_state(
                transport, node, "run", min_epoch=2, expected=expected, config=CONFIG
            )


async def test_a_download_waits_for_the_epoch_it_arrives_at_then_takes_a_newer_one():
    """With rounds in the background a donor serves the state of its epoch once the round
    before it lands: a newcomer arriving there waits for it (``wait_for_epoch``) rather than
    take the older state, and takes that one when the wait runs out."""
    older, newer = trained_state(1), trained_state(2)
    config = dataclasses.replace(CONFIG, min_agreement=1)
    async with AsyncExitStack() as stack:
        _, donor_node, donor = await stack.enter_async_context(peer([], config=config))
        await serve(donor, StateSnapshot.capture(3, older))
        transport, node, _ = await stack.enter_async_context(peer([donor_node.address]))

        def download(wait_s: float):
            return download_state(
                transport,
                node,
                "run",
                min_epoch=3,
                expected=layout_of(older),
                config=config,
                wait_s=wait_s,
                wait_for_epoch=4,
            )

        # nothing newer comes: after the wait, the state of epoch 3
        got = await download(wait_s=1.0)
        assert got.epoch == 3 and torch.equal(
            got.tensors["model.0.weight"], older["model.0.weight"]
        )
        # the round in flight lands while the download waits: the state of epoch 4
        waiting = asyncio.create_task(download(wait_s=30.0))
        await asyncio.sleep(0.6)
        assert not waiting.done()
        await serve(donor, StateSnapshot.capture(4, newer))
        got = await asyncio.wait_for(waiting, 30)
        assert got.epoch == 4 and torch.equal(
            got.tensors["model.0.weight"], newer["model.0.weight"]
        )


async def test_bf16_compression_halves_the_bytes_within_its_bound():
    state = trained_state(3)
    float_bytes = sum(t.numel() * 4 for t in state.values() if t.dtype == torch.float32)
    other_bytes = sum(
        t.numel() * t.element_size() for t in state.values() if t.dtype != torch.float32
    )
    compressed = dataclasses.replace(CONFIG, compression="bf16")
    received = {}
    async with AsyncExitStack() as stack:
        _, donor_node, donor = await stack.enter_async_context(peer([]))
        await serve(donor, StateSnapshot.capture(3, state))
        transport, node, _ = await stack.enter_async_context(peer([donor_node.address]))
        for name, config in (("none", CONFIG), ("bf16", compressed)):
            before = transport.counters.recv
            got = await download_state(
                transport, node, "run", min_epoch=3, expected=layout_of(state), config=config
            )
            received[name] = (got, transport.counters.recv - before)
    exact, exact_bytes = received["none"]
    got, got_bytes = received["bf16"]
    # tensor bytes: float32 halved, the rest as is (headers and DHT lookups on top of both)
    assert exact_bytes - got_bytes == pytest.approx(float_bytes / 2, rel=0.02)
    assert got_bytes >= float_bytes / 2 + other_bytes
    for name, tensor in state.items():
        assert got.tensors[name].dtype == tensor.dtype, name
        if tensor.dtype == torch.float32:
            error = (got.tensors[name].double() - tensor.double()).abs()
            assert torch.all(error <= tensor.double().abs() * 2**-8), name
        else:
            assert torch.equal(got.tensors[name], tensor), name
        assert torch.equal(exact.tensors[name], tensor), name


def test_unknown_compression_is_refused_by_name():
    with pytest.raises(ConfigError, match="compression"):
        StateSyncConfig(compression="zip")


async def test_an_announcement_overtaken_by_a_newer_one_is_not_refused(caplog):
    # The periodic announcement and the one after a digest can be on their way at once. Were
    # the newer record to reach every replica first, each would refuse the older one: a lost
    # request and a WARNING of a failed store, with nothing wrong.
    faults = Faults()
    async with AsyncExitStack() as stack:
        _, first_node, donor = await stack.enter_async_context(peer([], faults))
        for _ in range(3):  # replicas other than the donor, so that stores go over the network
            await stack.enter_async_context(peer([first_node.address]))
        await serve(donor, StateSnapshot.capture(3, trained_state(0)))
        with caplog.at_level("WARNING"):
            faults.delay_s = 0.5
            slow = asyncio.create_task(donor.announce())
            await asyncio.sleep(0.1)
            faults.delay_s = 0.0
            await donor.announce()
            await slow
    failed = [r.getMessage() for r in caplog.records if "store of" in r.getMessage()]
    assert not failed, failed
