"""The network stack: who a peer is, how it reaches others, and the DHT they share.

Start here:

* :mod:`dht.facade` (``DHT``): a blocking DHT for code outside the event loop;
  :mod:`dht.launch` (``open_node``): a node on its own transport, as every command starts one;
* :mod:`dht.config`: the settings a user passes; :mod:`dht.options`: the network flags every
  networked command shares; :mod:`dht.errors`: the one exception tree;
* :mod:`dht.http` (``HttpTransport``): the transport a node runs, the rooms below assembled.

The rooms, lowest first (each ``__init__`` says what it owns and may import):

* :mod:`dht.errors`, :mod:`dht.identity`: the base every room may import;
* :mod:`dht.net`: the transport: how a request is signed, sent, proven, limited and dispatched;
* :mod:`dht.reach`: getting through NAT: reachability checks, UPnP port mapping, relays;
* :mod:`dht.kademlia`: the DHT itself: routing, lookups, storage, records and their validation;
* :mod:`dht.tools`: benches, an in-memory network for simulations, fault injection.

The top-level modules are the front door: they assemble the rooms and may import any of them;
no room imports the front door. ``tests/test_layering.py`` holds the rule.
"""
