"""The report of a sweep: ``report.md``, PNG plots, CSV tables, and the study's reading.

Owns the writer, the plots, the study (seeds pooled with their spread, findings) and the
fairness checks of the comparison.

May import: :mod:`experiments.spec`, :mod:`experiments.analysis`,
:mod:`experiments.calibration`. Nothing that launches a process.
"""
