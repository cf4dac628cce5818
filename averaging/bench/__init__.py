"""``peer bench allreduce``: real peer processes on loopback average random vectors.

May import: the front door :mod:`averaging.averager`, :mod:`averaging.config`,
:mod:`averaging.rules`. Nothing in :mod:`averaging` imports this.
"""
