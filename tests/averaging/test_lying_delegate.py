"""A delegate that lies to its row, spreading other values than the top round's, reaches that
row only: every other row ends with the exact global mean. The trust bound of the two-level
round (docs/ARCHITECTURE.md, "Security"), attacked on real sockets."""

from __future__ import annotations

import numpy as np
import pytest

from tests.averaging.conftest import exact_mean
from tests.averaging.test_levels import rows_of, rows_of_three, run_round

pytestmark = pytest.mark.timeout(90)

LIE = 1000.0  # what the lying delegate spreads instead of the top round's mean


def _is_spread(group, peer_id: str) -> bool:
    # the spread round: the delegate weighs 1 and every other member 0 (averaging.spread)
    return all(m.weight == (1.0 if m.peer_id == peer_id else 0.0) for m in group.members)


async def test_a_delegate_that_lies_in_the_spread_reaches_its_own_row_only(make_swarm):
    peers, vectors, weights = await rows_of_three(make_swarm, seed=11)
    liar: list[str] = []

    def lying(peer):
        allreduce = peer.averager._second.allreduce

        async def lie_in_the_spread(group, timeout_s):
            if _is_spread(group, peer.peer_id) and not liar:
                liar.append(peer.peer_id)  # honest at the top, then this to its row
                peer.averager._group_rounds._tensors.flat[:] = LIE
            return await allreduce(group, timeout_s)

        peer.averager._second.allreduce = lie_in_the_spread

    for peer in peers:
        lying(peer)

    results = await run_round(peers, weights)

    assert liar, "no delegate reached its spread"
    global_mean = exact_mean(vectors, weights)  # the liar's row mean went to the top honestly
    rows = rows_of([r for r in results if r.levels.get("row") == "ok"])
    liar_row = next(r for r in rows if liar[0] in r)
    index = {p.peer_id: i for i, p in enumerate(peers)}
    members = sorted(index[p] for p in liar_row)
    liar_row_mean = exact_mean([vectors[i] for i in members], [weights[i] for i in members])
    num_exact = 0
    for peer, result in zip(peers, results, strict=True):
        values = peer.tensors[0]
        assert np.isfinite(values).all()
        if peer.peer_id in liar_row:
            # fooled where the spread delivered (it cannot tell the delegate's values from the
            # top round's), its row mean where it did not
            lied = values == LIE
            np.testing.assert_allclose(values[~lied], liar_row_mean[~lied], rtol=1e-5, atol=1e-6)
            assert lied.all() or result.levels.get("spread") != "ok", result
        elif "ok" in (result.levels.get("spread"), result.levels.get("top")):
            np.testing.assert_allclose(values, global_mean, rtol=1e-5, atol=1e-6)
            num_exact += 1
    assert num_exact >= len(peers) - len(liar_row) - 1, (num_exact, [r.levels for r in results])
