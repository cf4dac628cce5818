"""Averaging: matchmaking and a fault-tolerant, compressed butterfly all-reduce.

Peers that reached the same epoch find each other through the DHT (:mod:`averaging.matchmaking`)
and average their tensors, weighted by the samples each contributed, in a butterfly all-reduce
streamed over the transport (:mod:`averaging.allreduce`), optionally compressed and combined by
a robust rule (:mod:`averaging.rules`). A peer that dies or stalls is dropped and the round
completes without it; the result says who was dropped and how much was averaged.

The entry point is :class:`averaging.averager.DecentralizedAverager` (the front door, which may
import every room). The base every room may import: :mod:`averaging.errors`,
:mod:`averaging.bounds` (what a member may claim), :mod:`averaging.result`,
:mod:`averaging.tensors`, :mod:`averaging.work`; :mod:`averaging.config` sits on the base and
:mod:`averaging.rules`. Rooms, lowest first: rules, matchmaking, allreduce; then the bench.
This package talks to the network only through :class:`dht.net.transport.Transport` (it never
imports aiohttp). ``tests/test_layering.py`` holds the rule.
"""
