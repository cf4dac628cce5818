"""Launchers: where and how a configuration's processes run (local, netns, ssh).

Owns the launcher interface (:mod:`experiments.launch.base`), each launcher, the netns links
(uplinks, NAT) and the guard that deletes a sweep's namespaces.

May import: :mod:`experiments.spec`, :mod:`experiments.analysis`, :mod:`experiments.watching`,
:mod:`experiments.linkemu`.
"""
