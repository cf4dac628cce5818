"""Controlled experiments: a spec (TOML) in, a report a researcher can defend out.

The front door: :mod:`experiments.command` (``peer experiment``), :mod:`experiments.sweep`
(every configuration of a spec, in turn) and :mod:`experiments.runner` (one configuration: its
processes, watching them, the stopping rules). The base every room may import:
:mod:`experiments.spec`, :mod:`experiments.analysis` (numbers from the metrics streams),
:mod:`experiments.watching`. Rooms, lowest first: :mod:`experiments.linkemu` (link emulation),
:mod:`experiments.launch` (launchers), :mod:`experiments.calibration` (fair baselines),
:mod:`experiments.report`. ``tests/test_layering.py`` holds the rule.
"""
