"""Checking the records of find answers: what a re-read costs, and that it still refuses a
forgery (dht.kademlia.record_checks)."""

from __future__ import annotations

import dataclasses

import pytest

from dht.identity import PeerIdentity
from dht.kademlia.record_checks import INLINE_RECORDS, RecordChecker, VerifiedRecords
from dht.kademlia.routing import DHTID
from dht.kademlia.validation import OwnerSignatureValidator, owner_subkey, sign_record
from dht.net.fair_work import FairWork
from dht.net.wire import pack

pytestmark = pytest.mark.timeout(30)

KEY = DHTID.from_key("run/progress/0/0")
EXPIRATION = 1_900_000_000.0


def signed(identity: PeerIdentity, epoch: int):
    subkey = owner_subkey(identity.peer_id)
    return subkey, sign_record(identity, KEY, subkey, pack({"epoch": epoch}), EXPIRATION)


def make_checker() -> tuple[RecordChecker, FairWork]:
    work = FairWork(
        max_units=10_000, max_units_per_peer=10_000, max_units_per_address=10_000, unit="checks"
    )
    return RecordChecker(OwnerSignatureValidator(), work=work, verified=VerifiedRecords()), work


async def test_a_bucket_read_again_sends_only_its_new_records_to_the_worker():
    checker, work = make_checker()
    peers = [PeerIdentity.generate() for _ in range(3 * INLINE_RECORDS)]
    items = [signed(identity, 1) for identity in peers]
    try:
        assert len(await checker.valid_records(KEY, items, "replica 1", peer="a")) == len(peers)
        assert work.num_jobs_done == 1  # new records, more than are checked on the loop
        # the same versions from another replica: already verified, no trip to the worker
        assert len(await checker.valid_records(KEY, items, "replica 2", peer="b")) == len(peers)
        assert work.num_jobs_done == 1
        # a few peers published again: their records are checked on the loop
        items[:3] = [signed(identity, 2) for identity in peers[:3]]
        assert len(await checker.valid_records(KEY, items, "replica 3", peer="c")) == len(peers)
        assert work.num_jobs_done == 1
        # a forgery among verified records is dropped, the others kept
        subkey, record = items[5]
        items[5] = (subkey, dataclasses.replace(record, value_bytes=pack({"epoch": 99})))
        valid = await checker.valid_records(KEY, items, "liar", peer="d")
        assert subkey not in valid and len(valid) == len(peers) - 1
        assert checker.num_invalid_records == 1
    finally:
        await work.close()
