"""The dependency direction of DESIGN.md, checked on the transitive closure of every module's
imports (function-level imports included), and in a fresh interpreter for the torch-free rooms."""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("dht", "averaging", "peer", "monitor", "experiments")
# What each package's closure may reach (by top-level package, or module prefix for monitor).
ALLOWED = {
    "dht": ("dht",),
    "averaging": ("dht", "averaging"),
    "peer": ("dht", "averaging", "peer"),
    "monitor": ("dht", "monitor", "peer.records", "peer"),
    "experiments": ("dht", "averaging", "peer", "experiments"),
}
# The composition root: only `peer/cli/` (and `python -m peer`, which runs it) may import
# `monitor` and `experiments`.
COMPOSITION_ROOT = "peer.cli"
ENTRY_POINTS = {"peer.__main__"}
FORBIDDEN_THIRD_PARTY = {"averaging": {"aiohttp"}, "dht": {"pickle"}}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for package in OURS for p in sorted((ROOT / package).rglob("*.py"))}


MODULES = all_modules()


def _with_parents(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & MODULES.keys()


@cache
def direct_imports(module: str) -> frozenset[str]:
    """Every module of ours that ``module`` imports (anywhere in the file), with its packages."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found |= _with_parents(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found |= _with_parents(base)
            for alias in node.names:
                found |= _with_parents(f"{base}.{alias.name}")
    found.discard(module)
    return frozenset(found)


@cache
def closure(module: str) -> frozenset[str]:
    seen: set[str] = set()
    todo = [module]
    while todo:
        for dep in direct_imports(todo.pop()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    seen.discard(module)
    return frozenset(seen)


def third_party(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def in_composition_root(module: str) -> bool:
    return module in ENTRY_POINTS or module == COMPOSITION_ROOT or module.startswith("peer.cli.")


def _allowed(importer: str, dep: str) -> bool:
    package = importer.split(".")[0]
    if in_composition_root(importer):
        return True
    if package == "monitor" and dep.startswith("peer"):
        # the dashboard reads the record formats and nothing else of the training peer
        return dep in ("peer", "peer.records") or dep.startswith("peer.records.")
    return dep.split(".")[0] in ALLOWED[package]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_flow_one_way(module: str):
    """Nothing a module reaches, directly or through others, breaks the direction."""
    bad = sorted(dep for dep in closure(module) if not _allowed(module, dep))
    assert not bad, f"{module} reaches {bad}"
    package = module.split(".")[0]
    assert not third_party(MODULES[module]) & FORBIDDEN_THIRD_PARTY.get(package, set())


def test_only_the_cli_imports_monitor_and_experiments():
    for module in MODULES:
        if module.split(".")[0] in ("monitor", "experiments"):
            continue
        if in_composition_root(module):
            continue
        reached = {dep.split(".")[0] for dep in direct_imports(module)}
        assert not reached & {"monitor", "experiments"}, module


def test_closure_sees_indirect_imports():
    """The checker itself: a package reached through another module counts."""
    assert "dht.node" in closure("monitor.reader")
    assert any(dep.startswith("peer.records.") for dep in closure("monitor.app"))


def test_nothing_unpickles():
    for path in MODULES.values():
        assert "pickle" not in third_party(path), path


@pytest.mark.timeout(60)
@pytest.mark.parametrize("module", ["peer.records", "monitor.app", "monitor.command"])
def test_torch_free_rooms(module: str):
    """The record formats and the dashboard load without torch or numpy (a fresh interpreter)."""
    code = (
        f"import sys, importlib; importlib.import_module({module!r}); "
        "import peer.records.progress, peer.records.rounds, peer.records.profile; "
        "print(sorted(m for m in ('torch', 'numpy', 'averaging') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"{module} pulls in {out.stdout.strip()}"
