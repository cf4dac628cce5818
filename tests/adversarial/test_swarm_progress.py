"""Progress a minority cannot steer: forged progress records, in the estimate and over a real DHT.

The end-to-end version (``peer join`` processes and an attacker storing records through the
real DHT code) is in ``test_swarm_e2e.py``.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest

from dht.config import DHTConfig, get_dht_time
from dht.identity import PeerIdentity
from dht.kademlia.validation import owner_subkey
from dht.launch import open_node
from dht.net.config import TransportConfig
from peer.records.progress import PeerProgress, bucket_key
from peer.swarm.progress import ProgressConfig, ProgressTracker, estimate

pytestmark = pytest.mark.timeout(60)
NOW = 1000.0
CONFIG = ProgressConfig(target_batch_size=1000)


def peer_id(index: int) -> str:
    return f"{index:064x}"


def record(index: int, epoch: int, samples: int, rate: float = 10.0, age_s: float = 0.0):
    return PeerProgress(peer_id(index), epoch, samples, rate, NOW - age_s, None, False)


OWN = record(0, 5, 100)
HONEST = [record(1, 5, 100), record(2, 5, 100)]
PARTNERS = frozenset({peer_id(1), peer_id(2)})


def test_a_strangers_target_reached_record_does_not_end_an_honest_epoch():
    liar = record(9, 5, 10**6, rate=1e6)
    view = estimate([*HONEST, liar], own=OWN, config=CONFIG, now=NOW, partners=PARTNERS)
    assert view.samples_accumulated == 300 and not view.ready
    assert view.samples_per_s == 30  # nor its rate (the ETA is the partners')
    assert view.num_peers == 4  # it is seen: a seat in the group is there for it
    # many strangers do not either
    liars = [record(10 + i, 5, 10**6, rate=1e6) for i in range(20)]
    view = estimate([*HONEST, *liars], own=OWN, config=CONFIG, now=NOW, partners=PARTNERS)
    assert view.samples_accumulated == 300


def test_fresh_keys_far_ahead_do_not_move_the_swarm_epoch():
    liars = [record(9, 2**53 - 1, 0), record(8, 2**53 - 1, 0)]
    # with partners: two of them must be there (or a third of the peers, two epochs ahead)
    honest = [*HONEST, *(record(3 + i, 5, 100) for i in range(3))]
    view = estimate([*honest, *liars], own=OWN, config=CONFIG, now=NOW, partners=PARTNERS)
    assert view.epoch == 5
    # a newcomer with no partner yet: a strict majority of the peers it sees must be there (or,
    # two epochs ahead of it, a third and at least three)
    assert estimate([*HONEST, *liars], own=record(0, 0, 0), config=CONFIG, now=NOW).epoch == 5
    assert estimate([*honest, *liars], own=record(0, 0, 0), config=CONFIG, now=NOW).epoch == 5
    # while the honest peers moving on move it, whoever else is there
    ahead = [record(1, 6, 0), record(2, 6, 0)]
    assert estimate([*ahead, *liars], own=OWN, config=CONFIG, now=NOW, partners=PARTNERS).epoch == 6
    # the only partner left moves it alone (a swarm of two)
    assert (
        estimate([record(1, 7, 0)], own=OWN, config=CONFIG, now=NOW, partners=PARTNERS).epoch == 7
    )


def test_a_swarm_split_in_two_merges_forward_and_one_epoch_ahead_is_no_split():
    behind = [record(1 + i, 5, 100) for i in range(6)]
    partners = frozenset(r.peer_id for r in behind[:3])
    ahead = [record(20 + i, 9, 0) for i in range(3)]  # the first peers of the run, on their own
    view = estimate([*behind, *ahead], own=OWN, config=CONFIG, now=NOW, partners=partners)
    assert view.epoch == 9  # a third of the others, four epochs ahead: catch up with them
    assert estimate([*behind, *ahead[:2]], own=OWN, config=CONFIG, now=NOW,
                    partners=partners).epoch == 5  # fmt: skip  # two of eight: no
    one_ahead = [record(20 + i, 6, 0) for i in range(3)]  # their round ended first
    assert estimate([*behind, *one_ahead], own=OWN, config=CONFIG, now=NOW,
                    partners=partners).epoch == 5  # fmt: skip


def test_a_partner_claims_no_more_than_its_rate_allows_since_the_round():
    # both left the round of epoch 4 together 2 s ago; 100 samples/s allow 100 * (2 + 5) = 700
    round_peers = {peer_id(1): (5, NOW - 2.0)}
    greedy = record(1, 5, 999, rate=100.0)
    view = estimate(
        [greedy],
        own=record(0, 5, 0, rate=100.0),
        config=CONFIG,
        now=NOW,
        round_peers=round_peers,
        partners=frozenset({peer_id(1)}),
    )
    assert view.samples_accumulated == 700


def test_a_claimed_rate_counts_at_most_a_multiple_of_the_median():
    peers = [record(1, 5, 0, rate=10.0), record(2, 5, 0, rate=10.0), record(3, 5, 0, rate=1e6)]
    view = estimate(
        peers,
        own=record(0, 5, 0, rate=10.0),
        config=CONFIG,
        now=NOW,
        partners=PARTNERS | {peer_id(3)},
    )
    assert view.samples_per_s == 10 + 10 + 10 + 16 * 10


def test_no_record_counts_beyond_the_target_even_for_a_newcomer():
    view = estimate([record(1, 0, 10**15)], own=record(0, 0, 0), config=CONFIG, now=NOW)
    assert view.samples_accumulated == CONFIG.target_batch_size


async def test_forged_records_over_a_real_dht_never_reach_the_training_thread():
    """A stranger (a fresh key, its own DHT node) stores forged records under the run's key; the
    honest tracker reads them through the real DHT and its estimate stays computable."""
    config = ProgressConfig(target_batch_size=1000, publish_interval_s=0.2, record_ttl_s=5)
    async with AsyncExitStack() as stack:
        honest = await stack.enter_async_context(
            open_node(PeerIdentity.generate(), TransportConfig(), DHTConfig())
        )
        attacker = await stack.enter_async_context(
            open_node(
                PeerIdentity.generate(),
                TransportConfig(),
                DHTConfig(initial_peers=[honest.address]),
            )
        )
        tracker = ProgressTracker(dht=honest, prefix="run", config=config)
        tracker.report_local_progress(3, 10)
        expiration = get_dht_time() + 30
        forged = [
            {"epoch": 4, "samples": "9" * 401, "samples_per_s": 1.0, "time": get_dht_time()},
            {"epoch": 2**63, "samples": 1, "samples_per_s": 1.0, "time": get_dht_time()},
            {"epoch": 4, "samples": 1, "samples_per_s": float("inf"), "time": 1.0},
            {"epoch": 4, "samples": 1, "samples_per_s": 1.0, "time": 1.0, "address": "x"},
        ]
        for index, value in enumerate(forged):  # each replaces the last (a later expiration)
            assert await attacker.store(
                bucket_key("run", 0, 0),  # the one bucket of a small swarm's layout
                value,
                expiration + index,
                subkey=owner_subkey(attacker.peer_id),
            )
            view = await tracker.refresh()
            assert view.epoch == 3 and view.num_peers == 1
            assert tracker.current().epoch == 3


def test_a_top_round_count_claimed_high_stands_for_no_more_peers_than_were_read():
    """After rows and a top round, the partners' samples stand for the peers the round reached
    (progress_estimate._stand_for). A delegate claiming a huge count (the wire allows up to
    MAX_COUNT) scales them only up to the records read, and a stranger's "target reached"
    record still counts for nothing."""
    liar = record(9, 5, 10**6, rate=1e6)
    view = estimate(
        [*HONEST, liar], own=OWN, config=CONFIG, now=NOW, partners=PARTNERS, round_reach=(5, 10**4)
    )
    # 3 counted (this peer and its 2 partners, 300 samples) stand for the 4 peers read
    assert view.samples_accumulated == 400 and not view.ready
    assert view.samples_per_s == 40
