"""Re-checking the records a ``find`` answer carries, in bounded work per answer.

A reader trusts no replica, so every signed record that comes back is verified again (an
Ed25519 verification, about 125 us). Done naively on the event loop, one answer of 26,000 forged
records froze a reader for seconds and wrote a log line per record. Here:

* an answer with more than ``max_records_per_answer`` records is refused whole (an honest node
  holds at most what its per-key caps allow and answers with at most that many);
* records are verified in a worker thread in batches (the event loop keeps serving), and a
  record verified once is remembered (a bounded cache): Sybil records stored within a key's cap
  cost each reader one verification, not one per read;
* an honest node validated every record before storing it, so an answer holding invalid
  records comes from a liar: after ``max_invalid_per_answer`` of them the rest of its entry is
  dropped unchecked;
* invalid records are counted, and logged as one WARNING line a minute at most.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections import OrderedDict

from dht.errors import ValidationError
from dht.kademlia.storage import Record
from dht.kademlia.subkeys import Subkey
from dht.kademlia.validation import RecordValidator

logger = logging.getLogger(__name__)

INLINE_RECORDS = 16  # answers this small are checked on the loop (a thread hop costs more)
BATCH_RECORDS = 256  # records per worker-thread batch
LOG_INTERVAL_S = 60.0


class RecordChecker:
    """Validates the records of ``find`` answers with bounded work.

    Args:
        validator: the check every record passes (signatures of owner subkeys).
        max_records_per_answer: the most records one answer may carry; more is refused whole.
        max_invalid_per_answer: invalid records after which the rest of an answer is dropped.
        max_cached: verified records remembered.
    """

    def __init__(
        self,
        validator: RecordValidator,
        *,
        max_records_per_answer: int = 8192,
        max_invalid_per_answer: int = 4,
        max_cached: int = 65536,
    ):
        self.validator = validator
        self.max_records_per_answer = max_records_per_answer
        self.max_invalid_per_answer = max_invalid_per_answer
        self.max_cached = max_cached
        self.num_invalid_records = 0
        self.num_refused_answers = 0
        self._valid: OrderedDict[bytes, None] = OrderedDict()
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

    async def valid_records(
        self, key_id: int, items: list[tuple[Subkey | None, Record]], source: str
    ) -> dict[Subkey | None, Record]:
        """The records of ``items`` that pass, checked off the loop when there are many."""
        tally = [0]  # invalid records of this answer so far
        if len(items) <= INLINE_RECORDS:
            return self._check(key_id, items, source, tally)
        valid: dict[Subkey | None, Record] = {}
        for start in range(0, len(items), BATCH_RECORDS):
            batch = items[start : start + BATCH_RECORDS]
            valid.update(await asyncio.to_thread(self._check, key_id, batch, source, tally))
            if tally[0] >= self.max_invalid_per_answer:
                break
        return valid

    def _check(self, key_id: int, items, source: str, tally: list[int]) -> dict:
        valid: dict[Subkey | None, Record] = {}
        for subkey, record in items:
            if tally[0] >= self.max_invalid_per_answer:
                break  # a liar's answer: the rest is not worth a verification
            fingerprint = _fingerprint(key_id, subkey, record)
            with self._lock:
                known = fingerprint in self._valid
            if known:
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
            with self._lock:
                self._valid[fingerprint] = None
                while len(self._valid) > self.max_cached:
                    self._valid.popitem(last=False)
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
