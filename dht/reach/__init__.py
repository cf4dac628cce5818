"""Getting through NAT: can the swarm dial this node, and if not, how it is reached anyway.

Owns the reachability check (dial-backs), the UPnP port mapping on a home gateway, and relays:
the relay's side (:mod:`dht.reach.relay_server`), the relayed peer's tunnel
(:mod:`dht.reach.relay_client`) and the multiplexer between them (:mod:`dht.reach.relay_mux`).
:class:`dht.http.HttpTransport` assembles these with the transport.

May import: :mod:`dht.errors`, :mod:`dht.identity`, :mod:`dht.net`. Not Kademlia, not the
assembled transport (it names what it needs of it as a Protocol).
"""
