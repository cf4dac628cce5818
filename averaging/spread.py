"""Step 3 of a round's second level (:mod:`averaging.levels`): the delegate's word to its row.

Every member of a row asks its delegate (the ``spread`` request, a long poll bounded by
``top_round_timeout_s``) whether the top round averaged. If so, the row all-reduces once more
over the same members under a group id derived from the row's (:func:`spread_group`), where the
delegate weighs 1 and every other member 0: everyone receives the delegate's values. The answer
comes from another peer, so it is read as hostile (:meth:`Word.from_wire`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from averaging.config import AveragerConfig
from averaging.matchmaking.group import MAX_COUNT, GroupInfo
from dht.errors import DHTError

MAX_REASON_CHARS = 200
_STATUSES = ("ok", "partial", "failed", "alone", "unknown", "refused", "unreachable")


@dataclass(frozen=True)
class Word:
    """The delegate's answer to its row.

    Attributes:
        go: take the delegate's values (the spread follows); False: keep the row mean.
        top: the top round's status at the delegate ("ok", "partial", "failed", "alone"), or
            why there is no answer ("unknown", "refused", "unreachable").
        reason: why the top round is not "ok".
        num_reached: peers whose contributions are in the delegate's values.
    """

    go: bool
    top: str
    reason: str = ""
    num_reached: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "status": "go" if self.go else "keep",
            "top": self.top,
            "reason": self.reason[:MAX_REASON_CHARS],
            "reached": self.num_reached,
        }

    @classmethod
    def from_wire(cls, raw: Any) -> Word:
        """The delegate's answer as received (hostile: anything malformed is "keep")."""
        if not isinstance(raw, Mapping):
            return cls(False, "unknown", "malformed answer from the delegate")
        status, top, reason = raw.get("status"), raw.get("top"), raw.get("reason")
        reached = raw.get("reached")
        top = top if top in _STATUSES else "unknown"
        reason = reason[:MAX_REASON_CHARS] if isinstance(reason, str) else ""
        if not (isinstance(reached, int) and not isinstance(reached, bool)):
            reached = 0
        reached = max(0, min(reached, MAX_COUNT))
        if status == "go":
            return cls(True, top, reason, reached)
        return cls(False, top if status == "keep" else "unknown", reason or str(status)[:80], 0)


def spread_group(row: GroupInfo) -> GroupInfo:
    """The row's spread round: the same members, the delegate weighing 1 and the others 0,
    under an id derived from the row's (every member derives the same; no other round has it,
    as row ids are random)."""
    delegate = row.delegate
    members = tuple(
        dataclasses.replace(m, weight=1.0 if m.peer_id == delegate else 0.0, count=1)
        for m in row.members
    )
    group_id = hashlib.sha256(b"spread/" + row.group_id.encode()).hexdigest()[:32]
    return dataclasses.replace(row, group_id=group_id, members=members, top_rows=0)


class Spreads:
    """The ``spread`` request: a delegate answers its row's members when its top round ends.

    Args:
        transport: the network (the handler is added here).
        prefix: the averager's name.
        config: ``top_round_timeout_s``, ``allreduce_timeout_s`` and ``request_timeout_s``
            bound the long poll (at least; a row opened ``until`` a later time is answered
            until then).
    """

    def __init__(self, transport, prefix: str, config: AveragerConfig):
        self._transport = transport
        self._name = f"averaging.{prefix}.spread"
        self._wait_s = (
            config.top_round_timeout_s + config.allreduce_timeout_s + config.request_timeout_s
        )
        # row id: (the members but the delegate, the word, loop time the long poll ends)
        self._rows: dict[str, tuple[frozenset[str], asyncio.Future, float]] = {}
        transport.add_rpc_handler(self._name, self._on_spread)

    def open(self, row: GroupInfo, until: float = 0.0) -> None:
        """This peer is ``row``'s delegate: its members may ask from now on, and wait for its
        word until loop time ``until`` (its step's deadline: the top round may wait for rows
        still forming), or the config's bound if that is later."""
        loop = asyncio.get_running_loop()
        others = frozenset(row.peer_ids) - {self._transport.peer_id}
        until = max(until, loop.time() + self._wait_s)
        self._rows[row.group_id] = (others, loop.create_future(), until)

    def answer(self, row_id: str, word: Word) -> None:
        """Tell the members waiting (and those still to ask) of ``row_id``."""
        entry = self._rows.get(row_id)
        if entry is not None and not entry[1].done():
            entry[1].set_result(word)

    def close(self, row_id: str) -> None:
        """The delegate's step is over: members still waiting keep their row mean."""
        self.answer(row_id, Word(False, "failed", "the delegate's round ended without a word"))
        self._rows.pop(row_id, None)

    async def _on_spread(self, ctx, request: Any) -> dict[str, Any]:
        row_id = request.get("group") if isinstance(request, Mapping) else None
        entry = self._rows.get(row_id) if isinstance(row_id, str) else None
        if entry is None:
            return Word(False, "unknown", "the delegate knows no such row").to_wire()
        members, word, until = entry
        if ctx.sender not in members:  # only the row's own members may ask
            return Word(False, "refused", "not a member of this row").to_wire()
        try:
            async with asyncio.timeout_at(until):
                return (await asyncio.shield(word)).to_wire()
        except TimeoutError:
            return Word(False, "failed", "no word from the top round in time").to_wire()

    async def ask(self, row: GroupInfo, timeout_s: float) -> Word:
        """Wait (at most ``timeout_s``) for the word of ``row``'s delegate."""
        delegate = row.member(row.delegate)
        try:
            raw = await self._transport.call(
                delegate.address,
                self._name,
                {"group": row.group_id},
                timeout_s=max(0.001, timeout_s),
                expected_peer=delegate.peer_id,
            )
        except (DHTError, TimeoutError) as e:
            reason = f"the delegate did not answer: {e}"[:MAX_REASON_CHARS]
            return Word(False, "unreachable", reason)
        return Word.from_wire(raw)
