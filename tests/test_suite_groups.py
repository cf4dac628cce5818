"""The worker groups of ``make test`` (tests/conftest.py) name real files, and every test file
that makes network namespaces is in the ``netns`` group (two sweeps' namespaces at once on one
host would see each other's ``vpx-`` names)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import NETNS_FILES, PROCESS_HEAVY_FILES, SERIAL_FILES, SERIAL_MARKED_FILES

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
    for name in NETNS_FILES | PROCESS_HEAVY_FILES | SERIAL_FILES:
        assert (TESTS / name).is_file(), name
    assert not NETNS_FILES & PROCESS_HEAVY_FILES
    assert not SERIAL_FILES & (NETNS_FILES | PROCESS_HEAVY_FILES)


def test_every_file_that_makes_namespaces_is_in_the_netns_group():
    found = {
        path.relative_to(TESTS).as_posix()
        for path in TESTS.rglob("test_*.py")
        if MAKES_NAMESPACES.search(path.read_text())
    }
    assert found - NETNS_FILES - MAKES_NONE == set()


def test_every_file_with_a_serial_test_is_collected_in_the_serial_part():
    """``-m serial`` imports only the files the two lists name (tests/conftest.py), so a test
    marked ``serial`` in a file of neither would run in no part of ``make test``."""
    marked = {
        path.relative_to(TESTS).as_posix()
        for path in TESTS.rglob("test_*.py")
        if "mark.serial" in path.read_text() and path.name != "test_suite_groups.py"
    }
    assert marked == SERIAL_MARKED_FILES
    assert not SERIAL_MARKED_FILES & SERIAL_FILES


@pytest.mark.timeout(150)
def test_the_installed_xdist_keeps_a_group_on_one_worker(tmp_path: Path):
    """pytest-xdist's ``--dist loadgroup`` groups by rewriting node ids, which pytest 9 ignores:
    with it, the netns tests would run side by side and delete each other's namespaces."""
    (tmp_path / "test_grouped.py").write_text(
        "import os, pathlib, pytest\n"
        "pytestmark = pytest.mark.xdist_group('g')\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_worker(i):\n"
        "    pathlib.Path(f'worker-{i}').write_text(os.environ['PYTEST_XDIST_WORKER'])\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "3", "--dist", "loadgroup",
         "-p", "no:cacheprovider", "test_grouped.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    workers = {(tmp_path / f"worker-{i}").read_text() for i in range(6)}
    assert len(workers) == 1, workers
