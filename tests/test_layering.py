"""The dependency direction of DESIGN.md, checked on every module's imports."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = {"dht", "averaging", "peer", "monitor", "experiments"}
ALLOWED = {
    "dht": {"dht"},
    "averaging": {"dht", "averaging"},
    "peer": {"dht", "averaging", "peer"},
    "monitor": {"dht", "peer", "monitor"},
    "experiments": {"dht", "averaging", "peer", "experiments"},
}
# The composition root: the command line (``peer/cli.py`` and the ``peer/commands_*.py`` modules
# it wires) may import every package.


def is_cli_module(relative: str) -> bool:
    return relative == "peer/cli.py" or re.fullmatch(r"peer/commands_\w+\.py", relative) is not None


FORBIDDEN_THIRD_PARTY = {"averaging": {"aiohttp"}, "dht": {"pickle"}}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def modules() -> list[Path]:
    return sorted(p for package in OURS for p in (ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_flow_one_way(path: Path):
    relative = path.relative_to(ROOT).as_posix()
    package = relative.split("/")[0]
    imported = imported_modules(path)
    allowed = OURS if is_cli_module(relative) else ALLOWED[package]
    assert not (imported & OURS) - allowed, f"{relative} imports {(imported & OURS) - allowed}"
    assert not imported & FORBIDDEN_THIRD_PARTY.get(package, set())


def test_nothing_unpickles():
    for path in modules():
        assert "pickle" not in imported_modules(path), path
