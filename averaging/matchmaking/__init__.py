"""Matchmaking: peers that want to average under the same key form groups through the DHT.

Owns the search state, the follower's and leader's sides (:mod:`averaging.matchmaking.matchmaker`,
:mod:`averaging.matchmaking.leader`), the formed group as it travels on the wire
(:mod:`averaging.matchmaking.group`) and the partition every member derives from it.

May import: the base of :mod:`averaging`, :mod:`averaging.rules`, :mod:`averaging.config`.
Not the all-reduce.
"""
