"""Checking the records of ``store`` requests and ``find`` answers, in bounded, fair work.

A reader trusts no replica, so every signed record that comes back is verified again (an
Ed25519 verification, about 125 us). Done naively on the event loop, one answer of 26,000 forged
records froze a reader for seconds and wrote a log line per record. Here:

* an answer with more than ``max_records_per_answer`` records is refused whole (an honest node
  holds at most what its per-key caps allow and answers with at most that many);
* records are verified in a worker thread in batches (the event loop keeps serving), and a
  record verified once is remembered (a bounded cache): Sybil records stored within a key's cap
  cost each reader one verification, not one per read. An answer of at most 256 records is
  sorted into known and new on the loop first, so a key read again (or merged from several
  replicas) sends only its new records to the worker, and none when there are few;
* an honest node validated every record before storing it, so an answer holding invalid
  records comes from a liar: after ``max_invalid_per_answer`` of them the rest of its entry is
  dropped unchecked;
* invalid records are counted, and logged as one WARNING line a minute at most.

A ``store`` request (at most 64 records) is checked the same way before anything is stored:
records verified before cost nothing, a single new signature is checked on the loop (less work
than the request's own MAC and parsing), and more go to the node's signature-check queue
(:class:`dht.net.fair_work.FairWork`): one worker thread, in turns per source address and per
peer, each holding at most its share of the queue (more is refused at once, 429). Find answers'
batches take turns in the same queue under the answering peer, so one peer's flood of stores or
of forged records delays an honest peer's checks by at most one batch of each other holder.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections import OrderedDict

from dht.errors import BusyError, ValidationError
from dht.kademlia.storage import Record
from dht.kademlia.subkeys import Subkey
from dht.kademlia.validation import OwnerSignatureValidator, RecordValidator
from dht.net.fair_work import FairWork
from dht.net.shares import OverShare

logger = logging.getLogger(__name__)

INLINE_RECORDS = 16  # answers this small are checked on the loop (a thread hop costs more)
BATCH_RECORDS = 256  # records per worker-thread batch
# answers this small are sorted into verified and new on the loop (a fingerprint is a few us)
SORTED_ON_LOOP = 256
INLINE_STORE_CHECKS = 1  # new signatures of a store request checked on the loop, at most
LOG_INTERVAL_S = 60.0
MAX_VERIFIED = 65536  # verified records remembered in a process


class VerifiedRecords:
    """Fingerprints of records whose signature verified, bounded (oldest forgotten first).

    One per process by default (:data:`VERIFIED`): a verified signature is a fact whatever node
    checked it, so nodes of one process (a simulation) verify a record once.
    """

    def __init__(self, max_entries: int = MAX_VERIFIED):
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()  # worker threads add while the loop reads

    def __contains__(self, fingerprint: bytes) -> bool:
        with self._lock:
            return fingerprint in self._entries

    def add(self, fingerprint: bytes) -> None:
        with self._lock:
            self._entries[fingerprint] = None
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)


VERIFIED = VerifiedRecords()


class RecordChecker:
    """Validates the records of ``find`` answers with bounded work.

    Args:
        validator: the check every record passes (signatures of owner subkeys).
        max_records_per_answer: the most records one answer may carry; more is refused whole.
        max_invalid_per_answer: invalid records after which the rest of an answer is dropped.
        work: the node's signature-check queue (fair turns in a worker thread); None checks
            in a worker thread of its own per batch, with no shares.
        verified: the records known to pass (default: the process's for the owner-signature
            validator, whose verdict is the same on every node; one of its own for any other).
    """

    def __init__(
        self,
        validator: RecordValidator,
        *,
        max_records_per_answer: int = 8192,
        max_invalid_per_answer: int = 4,
        work: FairWork | None = None,
        verified: VerifiedRecords | None = None,
    ):
        self.validator = validator
        self.max_records_per_answer = max_records_per_answer
        self.max_invalid_per_answer = max_invalid_per_answer
        self.work = work
        self.num_invalid_records = 0
        self.num_refused_answers = 0
        if verified is None:
            shared = type(validator) is OwnerSignatureValidator
            verified = VERIFIED if shared else VerifiedRecords()
        self._verified = verified
        self._last_log_s = -float("inf")
        self._unlogged = 0
        self._lock = threading.Lock()  # batches of several answers may run at once

    def too_many(self, num_records: int) -> bool:
        """Whether an answer of ``num_records`` is refused whole (and counted)."""
        if num_records <= self.max_records_per_answer:
            return False
        self.num_refused_answers += 1
        self._log(f"an answer of {num_records} records (more than the cap) refused")
        return True

    def refuse_if_full(self, peer: str, host: str) -> None:
        """Raise :class:`BusyError` if ``peer`` at ``host`` holds its whole share of the queue
        (before its request is parsed: a flood past the share costs as little as possible)."""
        if self.work is not None and self.work.is_full_for(peer, host):
            raise BusyError("busy: this sender's signature checks fill its share; retry later")

    async def check_store(
        self, items: list[tuple[int, Subkey | None, Record]], peer: str, host: str
    ) -> None:
        """Check every record of a store request from ``peer`` at ``host`` (its source IP, ""
        when unknown) before any is stored.

        Raises:
            ValidationError: a record does not pass (the whole request is refused).
            BusyError: the new signatures do not fit in the sender's share of the queue.
        """
        todo = [item for item in items if _fingerprint(*item) not in self._verified]
        if len(todo) <= INLINE_STORE_CHECKS or self.work is None:
            self._check_store(todo)
            return
        try:
            await self.work.run(peer, host, len(todo), lambda: self._check_store(todo))
        except OverShare as e:
            raise BusyError(f"busy: {e}") from None

    def _check_store(self, items: list[tuple[int, Subkey | None, Record]]) -> None:
        for key_id, subkey, record in items:
            self.validator.validate(key_id, subkey, record)
            self._verified.add(_fingerprint(key_id, subkey, record))

    async def valid_records(
        self, key_id: int, items: list[tuple[Subkey | None, Record]], source: str, peer: str = ""
    ) -> dict[Subkey | None, Record]:
        """The records of ``items`` that pass, checked off the loop when there are many (in
        ``peer``'s turns of the signature-check queue; ``source`` names it in logs)."""
        tally = [0]  # invalid records of this answer so far
        valid: dict[Subkey | None, Record] = {}
        if len(items) <= SORTED_ON_LOOP:
            # most records of a re-read key were verified before (the same versions come from
            # every replica merged): only the new ones are worth a trip to the worker thread
            known, items = self._split_known(key_id, items)
            valid.update(known)
        if len(items) <= INLINE_RECORDS:
            valid.update(self._check(key_id, items, source, tally))
            return valid
        for start in range(0, len(items), BATCH_RECORDS):
            batch = items[start : start + BATCH_RECORDS]
            try:
                valid.update(await self._off_loop(peer, key_id, batch, source, tally))
            except OverShare:  # this peer's answers already fill its share: no more of them
                self.num_refused_answers += 1
                self._log(f"the rest of an answer from {source} dropped: its share is in use")
                break
            if tally[0] >= self.max_invalid_per_answer:
                break
        return valid

    def _split_known(self, key_id: int, items):
        """The records of ``items`` verified before, and the rest."""
        known: dict[Subkey | None, Record] = {}
        rest = []
        for subkey, record in items:
            if _fingerprint(key_id, subkey, record) in self._verified:
                known[subkey] = record
            else:
                rest.append((subkey, record))
        return known, rest

    async def _off_loop(self, peer: str, key_id: int, batch, source: str, tally: list[int]):
        if self.work is None:
            return await asyncio.to_thread(self._check, key_id, batch, source, tally)
        job = lambda: self._check(key_id, batch, source, tally)  # noqa: E731
        return await self.work.run(peer, "", len(batch), job, rated=False)  # a lookup's own

    def _check(self, key_id: int, items, source: str, tally: list[int]) -> dict:
        valid: dict[Subkey | None, Record] = {}
        for subkey, record in items:
            if tally[0] >= self.max_invalid_per_answer:
                break  # a liar's answer: the rest is not worth a verification
            fingerprint = _fingerprint(key_id, subkey, record)
            if fingerprint in self._verified:
                valid[subkey] = record
                continue
            try:
                self.validator.validate(key_id, subkey, record)
            except ValidationError as e:
                tally[0] += 1
                with self._lock:
                    self.num_invalid_records += 1
                    self._log(f"invalid record from {source} ignored: {e}")
                continue
            self._verified.add(fingerprint)
            valid[subkey] = record
        return valid

    def _log(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_log_s < LOG_INTERVAL_S:
            self._unlogged += 1
            return
        self._last_log_s = now
        logger.warning(
            "%s (%d invalid records, %d answers refused so far; %d lines not logged)",
            message[:200], self.num_invalid_records, self.num_refused_answers, self._unlogged,
        )  # fmt: skip
        self._unlogged = 0


def _fingerprint(key_id: int, subkey: Subkey | None, record: Record) -> bytes:
    digest = hashlib.sha256()
    for part in (key_id, subkey, record.expiration_time, record.signature):
        digest.update(repr(part).encode())
        digest.update(b"\0")
    digest.update(record.value_bytes)
    return digest.digest()
