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
    assert "dht.kademlia.node" in closure("monitor.reader")
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


# ---- rooms and circles ---------------------------------------------------------------------------

_DHT_BASE = {"dht.errors", "dht.identity"}
_AVG_BASE = {"averaging.errors", "averaging.bounds", "averaging.result", "averaging.tensors"}
_AVG_BASE |= {"averaging.work"}
_EXP_BASE = {"experiments.spec", "experiments.analysis", "experiments.watching"}
# The rooms of each package and the rooms each may import (a module's room is the longest
# prefix below that names it; the package's own name is its front door, the top-level modules a
# user imports first). Lower rooms never reach up: the transport knows nothing of Kademlia, NAT
# traversal nothing of the node, matchmaking nothing of the all-reduce.
ROOMS: dict[str, set[str]] = {
    "dht.errors": set(),
    "dht.identity": {"dht.errors"},
    "dht.net": _DHT_BASE | {"dht.net"},
    "dht.reach": _DHT_BASE | {"dht.net", "dht.reach"},
    "dht.kademlia": _DHT_BASE | {"dht.net", "dht.kademlia"},
    "dht": _DHT_BASE | {"dht", "dht.net", "dht.reach", "dht.kademlia"},
    "dht.tools": _DHT_BASE | {"dht", "dht.net", "dht.reach", "dht.kademlia", "dht.tools"},
    **{base: _AVG_BASE for base in _AVG_BASE},
    "averaging.rules": _AVG_BASE | {"averaging.rules"},
    "averaging.config": _AVG_BASE | {"averaging.rules"},
    "averaging.matchmaking": _AVG_BASE
    | {"averaging.rules", "averaging.config", "averaging.matchmaking"},
    "averaging.allreduce": _AVG_BASE
    | {"averaging.rules", "averaging.config", "averaging.matchmaking", "averaging.allreduce"},
    "averaging": _AVG_BASE
    | {"averaging", "averaging.rules", "averaging.config", "averaging.matchmaking"}
    | {"averaging.allreduce"},
    "averaging.bench": {"averaging", "averaging.rules", "averaging.config", "averaging.bench"},
    **{base: _EXP_BASE for base in _EXP_BASE},
    "experiments.linkemu": _EXP_BASE | {"experiments.linkemu"},
    "experiments.launch": _EXP_BASE | {"experiments.linkemu", "experiments.launch"},
    # the emulator's own fidelity check drives namespaces the way the netns launcher does
    "experiments.linkemu.fidelity": _EXP_BASE | {"experiments.linkemu", "experiments.launch"},
    "experiments.calibration": _EXP_BASE | {"experiments.launch"},
    "experiments.calibration_probe": _EXP_BASE,
    "experiments.report": _EXP_BASE | {"experiments.calibration", "experiments.report"},
}
ROOMS["experiments"] = {"experiments", *(room for room in ROOMS if room.startswith("experiments"))}


def room_of(module: str) -> str | None:
    """The room of ``module``: the longest prefix of it in ROOMS, or None (peer, monitor)."""
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in ROOMS:
            return prefix
    return None


@cache
def precise_imports(module: str) -> frozenset[str]:
    """The modules of ours that ``module`` names (anywhere in the file), without the packages
    above them: the edges of the module graph that an import circle would run along."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names} & MODULES.keys()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in MODULES else base)
    found &= MODULES.keys()
    found.discard(module)
    return frozenset(found)


def import_circles(edges=precise_imports) -> list[list[str]]:
    """Every strongly connected set of two or more modules (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for dep in edges(module):
            if dep not in index:
                visit(dep)
                low[module] = min(low[module], low[dep])
            elif dep in on_stack:
                low[module] = min(low[module], index[dep])
        if low[module] == index[module]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == module:
                    break
            if len(members) > 1:
                circles.append(sorted(members))

    for module in sorted(MODULES):
        if module not in index:
            visit(module)
    return circles


def test_no_module_imports_itself_through_others():
    """No import circles, TYPE_CHECKING and function-level imports included."""
    assert import_circles() == []


def test_the_circle_finder_finds_circles():
    """The checker itself: one made-up edge back from the transport to the node is a circle."""

    def edges(module: str) -> frozenset[str]:
        extra = {"dht.kademlia.node"} if module == "dht.net.wire" else set()
        return precise_imports(module) | extra

    assert any({"dht.net.wire", "dht.kademlia.node"} <= set(c) for c in import_circles(edges))


@pytest.mark.parametrize("module", sorted(m for m in MODULES if room_of(m)))
def test_rooms_import_only_the_rooms_below(module: str):
    """Within a package, a room imports only the rooms it sits on (ROOMS)."""
    room = room_of(module)
    package = module.split(".")[0]
    bad = sorted(
        dep
        for dep in precise_imports(module)
        if dep.split(".")[0] == package
        and dep != package
        and room_of(dep) not in ROOMS.get(room, {room}) | {room}
    )
    assert not bad, f"{module} (room {room}) imports {bad}"


def test_every_room_says_what_it_owns_and_may_import():
    """Each room's ``__init__`` docstring names what it owns and what it may import."""
    for room in ROOMS:
        path = ROOT.joinpath(*room.split("."), "__init__.py")
        if path.exists() and room not in OURS:
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            assert "May import" in doc, f"{room}/__init__.py says nothing of its imports"
