"""Launchers: where and how a configuration's processes run (local, netns, ssh, ray).

Owns the launcher interface (:mod:`experiments.launch.base`), each launcher, the netns links
(uplinks, NAT), the guard that deletes a sweep's namespaces, and the Ray actor that owns a
process on a cluster node (``ray_owner``).

May import: :mod:`experiments.spec`, :mod:`experiments.analysis`, :mod:`experiments.watching`,
:mod:`experiments.linkemu`.
"""
