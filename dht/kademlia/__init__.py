"""The DHT: store and get values, replicated on the k closest nodes.

Owns the node (:mod:`dht.kademlia.node`), ids and k-buckets (:mod:`dht.kademlia.routing`), the
iterative lookup, what a node holds (:mod:`dht.kademlia.storage`), the three RPCs
(:mod:`dht.kademlia.protocol`; their messages in :mod:`dht.kademlia.messages`), record
validation and owner subkeys, the node's upkeep, and its settings and clock
(:mod:`dht.kademlia.config`).

May import: :mod:`dht.errors`, :mod:`dht.identity`, :mod:`dht.net` (through the ``Transport``
interface and the wire formats only). Not NAT traversal.
"""
