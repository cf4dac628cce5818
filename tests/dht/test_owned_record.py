"""OwnedRecord over real DHT nodes: a re-store is never dated before the last one."""

from __future__ import annotations

from dht.kademlia.validation import owner_subkey
from dht.owned_record import OwnedRecord


async def test_a_shorter_lifetime_than_the_last_store_still_replaces_the_value(memory_swarm):
    swarm = await memory_swarm(8)
    writer, reader = swarm.nodes[0], swarm.nodes[-1]
    values = iter([{"epoch": 1}, {"epoch": 2}])
    record = OwnedRecord(
        dht=writer,
        key="progress",
        make_value=lambda now: (next(values), now),
        ttl_s=60.0,
        interval_s=None,
        name="test record",
    )
    subkey = owner_subkey(writer.peer_id)
    assert await record.publish()
    first = (await reader.get("progress", latest=True)).value[subkey]
    assert first.value == {"epoch": 1}
    # the owner's cycles got shorter: so does the lifetime it asks for (as progress does)
    record.ttl_s = 20.0
    assert await record.publish()  # refused as stale by every replica before the fix
    second = (await reader.get("progress", latest=True)).value[subkey]
    assert second.value == {"epoch": 2}
    # kept past the last expiration sent, no further: the value expires when the first would
    assert first.expiration_time < second.expiration_time < first.expiration_time + 1.0
    await record.close()
