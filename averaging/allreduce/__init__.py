"""The butterfly all-reduce over a formed group, fault-tolerant and streamed.

Owns one peer's side of a round (:mod:`averaging.allreduce.butterfly`), the stream protocol,
senders and reducers with their accumulators, the router of incoming streams, how many streams a
pair opens, and the deadlines that adapt to what this peer measured.

May import: the base of :mod:`averaging`, :mod:`averaging.rules`, :mod:`averaging.config`,
:mod:`averaging.matchmaking` (the group and its partition).
"""
