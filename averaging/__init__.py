"""Averaging: matchmaking and a fault-tolerant, compressed butterfly all-reduce.

Peers that reached the same epoch find each other through the DHT (:mod:`averaging.matchmaking`,
:mod:`averaging.leader`) and average their tensors, weighted by the samples each contributed, in
a butterfly all-reduce streamed over the transport (:mod:`averaging.allreduce`,
:mod:`averaging.sender`, :mod:`averaging.reducer`), optionally compressed
(:mod:`averaging.compression`). A peer that dies or stalls is dropped and the round completes
without it; the result says who was dropped and how much was averaged.

The entry point is :class:`averaging.averager.DecentralizedAverager`. This package talks to the
network only through :class:`dht.transport.Transport` (it never imports aiohttp).
"""
