"""The transport: how bytes reach another node, and how a request is proven and limited.

Owns the :class:`~dht.net.transport.Transport` interface every layer above talks to, the wire
formats (msgpack under limits, stream frames), proven identity (signed handshakes, session keys,
replay protection), the HTTP client and server with their budgets, and the transport's settings
(:mod:`dht.net.config`, reachability's included). Every untrusted body is parsed by
:mod:`dht.net.schema` before a field of it is read.

May import: :mod:`dht.errors`, :mod:`dht.identity`. Nothing of NAT traversal or Kademlia.
"""
