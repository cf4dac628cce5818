"""DecentralizedAverager end to end: torch tensors in place, the blocking facade, bad input."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from averaging.averager import DecentralizedAverager
from averaging.config import AveragerConfig
from averaging.errors import AveragingError, ConfigError
from dht.config import DHTConfig
from dht.http import HttpTransport
from dht.identity import PeerIdentity
from dht.kademlia.node import DHTNode
from dht.net.config import TransportConfig
from dht.runtime import EventLoopThread

from .conftest import exact_mean, fast_config

pytestmark = pytest.mark.timeout(60)


def model_tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(64, 33, generator=generator, requires_grad=True)
    bias = torch.randn(33, generator=generator, requires_grad=True)
    return [weight, bias, torch.randn(5, generator=generator, dtype=torch.float64)]


def flat(tensors) -> np.ndarray:
    return np.concatenate([t.detach().double().reshape(-1).numpy() for t in tensors])


async def test_step_averages_torch_tensors_in_place_and_reports(make_swarm):
    tensor_lists = [model_tensors(seed) for seed in range(3)]
    identities = [[id(t) for t in ts] for ts in tensor_lists]
    weights = [10.0, 20.0, 30.0]
    expected = exact_mean([flat(ts) for ts in tensor_lists], weights)
    peers = await make_swarm(tensor_lists, config=fast_config(target_group_size=3))

    results = await asyncio.gather(
        *(p.averager.step(weight=w, epoch=0) for p, w in zip(peers, weights, strict=True))
    )

    for peer, result, ids in zip(peers, results, identities, strict=True):
        assert [id(t) for t in peer.tensors] == ids
        assert peer.tensors[0].requires_grad and peer.tensors[2].dtype == torch.float64
        np.testing.assert_allclose(flat(peer.tensors), expected, rtol=1e-5, atol=1e-6)
        assert result.status == "ok" and result.reason == "" and not result.partial
        assert result.weights == dict(zip([p.peer_id for p in peers], weights, strict=True))
        assert result.dropped_peers == ()
        assert result.bytes_sent > 0 and result.bytes_received > 0
        assert result.matchmaking_s > 0 and result.allreduce_s > 0
        assert result.averaged_fraction == 1.0
        assert {"gather", "matchmaking", "allreduce", "scatter"} <= set(result.phase_s)
        assert result.round_s >= result.allreduce_s
        assert peer.averager.num_rounds == 1


async def test_peer_with_nan_takes_part_with_weight_zero(make_swarm):
    rng = np.random.default_rng(0)
    vectors = [rng.standard_normal(1_000).astype(np.float32) for _ in range(3)]
    vectors[1][17] = np.nan
    peers = await make_swarm([[v.copy()] for v in vectors], config=fast_config(target_group_size=3))

    results = await asyncio.gather(*(p.averager.step(weight=1.0, epoch=0) for p in peers))

    assert [r.status for r in results] == ["ok"] * 3
    assert results[0].weights[peers[1].peer_id] == 0.0
    expected = exact_mean([vectors[0], vectors[2]], [1.0, 1.0])
    for peer in peers:  # the NaN peer got the others' average back
        np.testing.assert_allclose(peer.tensors[0], expected, rtol=1e-5, atol=1e-6)


def test_blocking_facade_from_training_threads():
    """Each peer on its own event-loop thread; the training threads call step_blocking."""
    runners = [EventLoopThread(name=f"peer-{i}") for i in range(2)]
    tensors = [torch.full((1000,), float(i)) for i in range(2)]

    async def start(index: int, bootstrap: list[str]):
        identity = PeerIdentity.generate()
        transport = HttpTransport(identity, TransportConfig())
        node = DHTNode(
            transport=transport, identity=identity, config=DHTConfig(initial_peers=bootstrap)
        )
        averager = DecentralizedAverager(
            [tensors[index]], transport=transport, dht=node, prefix="facade",
            config=fast_config(target_group_size=2),
        )  # fmt: skip
        await transport.start()
        await node.start()
        return transport, node, averager

    async def stop(transport, node, averager):
        await averager.close()
        await node.close()
        await transport.close()

    started = []
    try:
        started.append(runners[0].run(start(0, []), timeout_s=30))
        started.append(runners[1].run(start(1, [started[0][0].address]), timeout_s=30))
        with ThreadPoolExecutor(2) as pool:
            futures = [
                pool.submit(averager.step_blocking, runner, 1.0 + index, epoch=0)
                for index, ((_, _, averager), runner) in enumerate(
                    zip(started, runners, strict=True)
                )
            ]
            results = [f.result(60) for f in futures]
        assert [r.status for r in results] == ["ok", "ok"]
        for tensor in tensors:  # (0 * 1 + 1 * 2) / 3
            np.testing.assert_allclose(tensor.numpy(), 2 / 3, rtol=1e-6)
    finally:
        for parts, runner in zip(started, runners, strict=False):
            runner.run(stop(*parts), timeout_s=30)
        for runner in runners:
            runner.close()


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"min_group_size": 5, "target_group_size": 4}, "min_group_size"),
        ({"target_group_size": 0}, "target_group_size"),
        ({"chunk_numel": 1000}, "chunk_numel"),
        ({"sender_timeout_s": 5.0, "reducer_timeout_s": 5.0}, "reducer_timeout_s"),
        ({"allreduce_timeout_s": float("inf")}, "allreduce_timeout_s"),
        ({"compression": "zip"}, "compression"),
        ({"bandwidth": 0}, "bandwidth"),
        ({"group_bits": "012"}, "group_bits"),
        ({"read_replicas": 0}, "read_replicas"),
        ({"read_replicas": True}, "read_replicas"),
        ({"read_replicas": 2.0}, "read_replicas"),
        ({"store_replicas": 0}, "store_replicas"),
        ({"read_replicas": 8, "store_replicas": 4}, "store_replicas"),
        ({"read_replicas": None, "store_replicas": 12}, "store_replicas"),
    ],
)
def test_config_errors_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        AveragerConfig(**changes)


async def test_bad_arguments_and_closed_averager(make_peers):
    (peer,) = await make_peers([[np.ones(4, np.float32)]], config=fast_config())
    averager = peer.averager
    with pytest.raises(ConfigError, match="timeout_s"):
        await averager.step_in_group(None, timeout_s=-1)
    with pytest.raises(AveragingError, match="no DHT"):
        await averager.step(weight=1.0)
    with pytest.raises(ConfigError, match="weight"):
        await averager.step(weight=float("nan"))
    with pytest.raises(ConfigError, match="prefix"):
        DecentralizedAverager([np.ones(1)], transport=peer.transport, dht=None, prefix="a b")
    with pytest.raises(ConfigError, match="floating"):
        DecentralizedAverager([np.ones(1, int)], transport=peer.transport, dht=None, prefix="x")
    await averager.close()
    await averager.close()  # safe twice
    with pytest.raises(AveragingError, match="closed"):
        await averager.step(weight=1.0)


async def test_the_median_rtt_is_computed_again_at_most_once_a_second(make_peers):
    # every deadline of every chunk asks for it: a median over thousands of samples each time
    # was 3% of a 64-peer bench process's CPU
    (peer,) = await make_peers([[np.ones(4, np.float32)]], config=fast_config())
    averager, counters = peer.averager, peer.transport.counters
    counters.rtt_samples.clear()
    assert averager._measured_rtt_s() is None  # nothing measured: asked again next time
    counters.add_rtt("a" * 64, 0.1)
    assert averager._measured_rtt_s() == pytest.approx(0.1)
    counters.add_rtt("b" * 64, 0.3)
    counters.add_rtt("c" * 64, 0.3)
    assert averager._measured_rtt_s() == pytest.approx(0.1)  # within the second: as before
    computed_s, rtt_s = averager._rtt_cache
    averager._rtt_cache = (computed_s - 1.0, rtt_s)
    assert averager._measured_rtt_s() == pytest.approx(0.3)
    await averager.close()
