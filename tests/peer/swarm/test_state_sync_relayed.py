"""A newcomer downloads the state of a donor that others reach only through a relay."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import torch

from dht.config import DHTConfig
from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.kademlia.node import DHTNode
from dht.net.config import TransportConfig
from peer.swarm.state_agreement import read_announcements
from peer.swarm.state_download import download_state, layout_of
from peer.swarm.state_sync import StateServer, StateSnapshot
from tests.peer.swarm.test_state_sync import CONFIG, serve, trained_state

pytestmark = pytest.mark.timeout(60)


async def start_node(stack: AsyncExitStack, initial: list[str], *, client_mode=False, relay=None):
    identity = PeerIdentity.generate()
    transport = HttpTransport(identity, TransportConfig(client_mode=client_mode))
    await stack.enter_async_context(transport)
    if relay is not None:  # before the node starts: it joins under its relayed address
        await transport.attach_relay([relay])
    node = DHTNode(transport=transport, identity=identity, config=DHTConfig(initial_peers=initial))
    await stack.enter_async_context(node)
    return transport, node


async def test_newcomer_gets_an_exact_copy_from_a_relayed_donor():
    state = trained_state(5)
    async with AsyncExitStack() as stack:
        relay, _ = await start_node(stack, [])
        donor, donor_node = await start_node(stack, [relay.address], relay=relay.address)
        server = StateServer(transport=donor, dht=donor_node, prefix="run", config=CONFIG)
        await stack.enter_async_context(server)
        await serve(server, StateSnapshot.capture(6, state, {"epoch": 6}))
        newcomer, node = await start_node(stack, [relay.address], client_mode=True)
        announced = await read_announcements(node, "run")
        assert [a.address for a in announced] == [f"{relay.address}/v2/relay/{donor.peer_id}"]
        got = await download_state(
            newcomer, node, "run", min_epoch=6, expected=layout_of(state), config=CONFIG
        )
        state_bytes = sum(t.numel() * t.element_size() for t in state.values())
        assert relay.relay.num_relayed_bytes > state_bytes  # it all came through the relay
    assert got.epoch == 6 and got.metadata == {"epoch": 6}
    assert got.tensors.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(got.tensors[name], tensor), name
