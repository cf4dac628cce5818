"""What a chunk looks like on the wire and how a reducer combines contributions to it.

Owns compression (none, fp16, 8-bit blockwise) and the aggregation rules (the weighted mean and
the robust ones).

May import: the base of :mod:`averaging` (errors, bounds, result, tensors, work).
"""
