"""A user-space link emulator for kernels without ``sch_netem`` (the mahimahi technique).

Each emulated link is a pair of TAP devices, one in each namespace it joins, and a forwarder
process that copies Ethernet frames between them, in each direction through a :class:`Shaper`:
random loss, a drop-tail queue drained at the link's rate, then a one-way delay with jitter.
See :mod:`experiments.linkemu.forwarder` (the process), :mod:`experiments.linkemu.emulator`
(starting and stopping it) and :mod:`experiments.linkemu.fidelity` (measuring what it does).

May import: :mod:`experiments.spec`, :mod:`experiments.analysis`; the fidelity check alone
also drives namespaces through :mod:`experiments.launch.netns`.
"""
