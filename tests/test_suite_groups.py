"""The worker groups of ``make test`` (tests/conftest.py) name real files, and every test file
that makes network namespaces is in the ``netns`` group (two sweeps' namespaces at once on one
host would see each other's ``vpx-`` names)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import NETNS_FILES, PROCESS_HEAVY_FILES

TESTS = Path(__file__).resolve().parent
# What a test file calls to make network namespaces, directly or through the launchers.
MAKES_NAMESPACES = re.compile(
    r"NetnsSession|NetnsLauncher|EmulatedPair|emulated_places|home_network|"
    r"launcher=\"netns\"|launcher = \\\"netns|from tests\.experiments\.test_nat import|"
    r"run_swarm\(|run_newcomer\("
)

# Files that name those but make none.
MAKES_NONE = {
    "experiments/test_spec.py",  # parses specs only
    "experiments/test_sweep_watch.py",  # a stand-in launcher
    "test_suite_groups.py",  # this file's pattern
}


def test_the_groups_name_test_files_that_exist():
    for name in NETNS_FILES | PROCESS_HEAVY_FILES:
        assert (TESTS / name).is_file(), name
    assert not NETNS_FILES & PROCESS_HEAVY_FILES


def test_every_file_that_makes_namespaces_is_in_the_netns_group():
    found = {
        path.relative_to(TESTS).as_posix()
        for path in TESTS.rglob("test_*.py")
        if MAKES_NAMESPACES.search(path.read_text())
    }
    assert found - NETNS_FILES - MAKES_NONE == set()
