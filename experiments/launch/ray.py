"""The ``ray`` launcher: a sweep on any Ray cluster, with the same spec, dashboard and report.

Per configuration, one placement group holds a bundle per peer (its CPUs from
``[resources]``; the baseline's one bundle has them all), ``STRICT_SPREAD`` over the nodes for
``placement = "spread"`` where the cluster has a node per bundle, else ``SPREAD``, or ``PACK``.
Every process (the bootstrap node on bundle 0 with 0 CPUs, each ``peer join``, the baseline) is
owned by one :class:`~experiments.launch.ray_owner.ProcessOwner` actor on its bundle, which
starts, pins and stops it on its node; this driver reads the files back by offset into the run
directory and writes ``placement.json`` (node id and address per process) for the report.

Nothing is left behind: closing a session stops the processes (SIGTERM, then SIGKILL), kills the
actors and removes the placement group; if this driver dies instead, Ray ends its job's actors
and their processes go with them (see :mod:`experiments.launch.ray_owner`). A placement group
the cluster cannot satisfy fails its configuration after ``ray.ready_timeout_s`` (Ray itself
would wait forever).

Ray is optional (``pip install 'volunteer-peer[ray]'``); this module imports it only when a
sweep with ``launcher = "ray"`` starts.
"""

from __future__ import annotations

import json
import logging
import signal
import uuid
from pathlib import Path
from typing import Any

from experiments.analysis import PLACEMENT_FILE
from experiments.launch.base import Launcher, LaunchError, ProcessPlan, Session
from experiments.launch.ray_owner import ProcessOwner
from experiments.spec import RaySpec, cpu_split

RAY_MISSING = (
    "launcher = 'ray' needs Ray, which is not installed: pip install 'volunteer-peer[ray]'"
)
# Bound on one call to an actor (its start included: a worker process may have to start first).
CALL_TIMEOUT_S = 60.0
# The exit status a process is given when its actor or node is gone (it was killed with them).
LOST_EXIT = -signal.SIGKILL


def import_ray() -> Any:
    """The ``ray`` module.

    Raises:
        LaunchError: Ray is not installed (one line saying how to install it).
    """
    try:
        import ray
    except ImportError:
        raise LaunchError(RAY_MISSING) from None
    return ray


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def _torch_threads(plan: ProcessPlan, cpus: int) -> int:
    """The ``--torch-threads`` the plan asks for (else one per CPU of its bundle)."""
    if "--torch-threads" in plan.args[:-1]:
        return int(plan.args[plan.args.index("--torch-threads") + 1])
    return max(1, cpus)


class RayHandle:
    """A process owned by a Ray actor; see :class:`~experiments.launch.base.Handle`."""

    def __init__(self, name: str, actor: Any, ray: Any, run_dir: Path):
        self.name, self.actor, self._ray, self.run_dir = name, actor, ray, run_dir
        self.lost = ""  # why the actor (and so the process) is gone, when it is
        self._offsets: dict[str, int] = {}
        self._terminated = False

    def _call(self, method: str, *args: object, **kwargs: object) -> Any:
        """``actor.method(*args, **kwargs)``; raises ray's errors (RayError, TimeoutError)."""
        reference = getattr(self.actor, method).remote(*args, **kwargs)
        return self._ray.get(reference, timeout=CALL_TIMEOUT_S)

    def _lose(self, error: BaseException) -> None:
        if not self.lost:
            self.lost = f"its Ray actor or node was lost: {_first_line(error)}"
            with (self.run_dir / f"{self.name}.log").open("a", encoding="utf-8") as log:
                log.write(f"ray: {self.name}: {self.lost}\n")

    def poll(self) -> int | None:
        if self.lost:
            return LOST_EXIT
        try:
            return self._call("poll")
        except (self._ray.exceptions.RayError, TimeoutError) as e:
            self._lose(e)
            return LOST_EXIT

    def terminate(self) -> None:
        if not self._terminated and not self.lost:
            self._terminated = True
            try:
                self._call("terminate")
            except (self._ray.exceptions.RayError, TimeoutError) as e:
                self._lose(e)

    def kill(self) -> None:
        if not self.lost:
            try:
                self._call("kill")
            except (self._ray.exceptions.RayError, TimeoutError) as e:
                self._lose(e)

    def pull(self, kind: str) -> None:
        """Append what is new in the node's ``<name>.<kind>`` to the run directory's copy."""
        if self.lost:
            return
        try:
            while chunk := self._call("read", kind, self._offsets.get(kind, 0)):
                with (self.run_dir / f"{self.name}.{kind}").open("ab") as copy:
                    copy.write(chunk)
                self._offsets[kind] = self._offsets.get(kind, 0) + len(chunk)
        except (self._ray.exceptions.RayError, TimeoutError) as e:
            self._lose(e)

    def release(self) -> None:
        """Delete the process's files on its node and end its actor (and so the process)."""
        try:
            if not self.lost:
                self._call("remove_files")
        except (self._ray.exceptions.RayError, TimeoutError):
            pass
        self._ray.kill(self.actor, no_restart=True)


class RaySession(Session):
    """One configuration on the cluster; see the module docstring."""

    def __init__(self, run_dir: Path, launcher: RayLauncher, num_peers: int):
        super().__init__(run_dir)
        self.ray, self.spec, self.num_peers = launcher.ray, launcher.spec, num_peers
        self.owner_class = launcher.owner_class
        self.work_dir = f"{launcher.sweep_tag}/{run_dir.name}"
        self.bundle_cpus = [len(b) for b in cpu_split(launcher.total_cpus, max(1, num_peers))]
        self.placements: list[dict[str, Any]] = []
        self._used_cpus: dict[str, int] = {}  # node id -> CPUs its pinned processes took
        self._closed = False
        self.group = self._placement_group()

    def _strategy(self) -> str:
        if self.spec.placement == "pack":
            return "PACK"
        biggest = max(self.bundle_cpus)
        nodes = [n for n in self.ray.nodes() if n.get("Alive")]
        fitting = [n for n in nodes if n.get("Resources", {}).get("CPU", 0) >= biggest]
        return "STRICT_SPREAD" if len(fitting) >= len(self.bundle_cpus) else "SPREAD"

    def _placement_group(self) -> Any:
        """The configuration's placement group, ready.

        Raises:
            LaunchError: the cluster did not place it within ``ray.ready_timeout_s``.
        """
        from ray.util.placement_group import placement_group, remove_placement_group

        strategy = self._strategy()
        bundles = [{"CPU": cpus} for cpus in self.bundle_cpus]
        group = placement_group(bundles, strategy=strategy, name=f"vp-{self.work_dir}")
        ready, _ = self.ray.wait([group.ready()], timeout=self.spec.ready_timeout_s)
        if ready:
            return group
        remove_placement_group(group)
        free = self.ray.available_resources().get("CPU", 0)
        sizes = ", ".join(str(cpus) for cpus in self.bundle_cpus)
        raise LaunchError(
            f"resources.total_cpus: the Ray cluster did not place bundles of {sizes} CPUs "
            f"({strategy}) within ray.ready_timeout_s = {self.spec.ready_timeout_s:g} s "
            f"({free:g} CPUs free); add nodes or CPUs, or lower resources.total_cpus"
        )

    def _bundle(self, plan: ProcessPlan) -> tuple[int, int]:
        """(bundle index, logical CPUs of its actor): the bootstrap takes 0 CPUs of bundle 0."""
        if plan.index is not None:
            return plan.index, self.bundle_cpus[plan.index]
        return 0, self.bundle_cpus[0] if self.num_peers == 0 else 0

    def _node_cpus(self, plan: ProcessPlan, where: dict[str, Any]) -> list[int] | None:
        """The node's CPU ids to pin ``plan`` to: the processes sharing a node take consecutive
        blocks of its CPUs (wrapping where the node has fewer than the bundles say)."""
        if plan.cpus is None:
            return None
        node_cpus, node = list(where["node_cpus"]), str(where["node_id"])
        start = self._used_cpus.get(node, 0)
        self._used_cpus[node] = start + len(plan.cpus)
        picked = [node_cpus[(start + k) % len(node_cpus)] for k in range(len(plan.cpus))]
        return sorted(set(picked))

    def start(self, plan: ProcessPlan) -> RayHandle:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle, num_cpus = self._bundle(plan)
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=bundle
        )
        owner = self.owner_class.options(
            num_cpus=num_cpus, max_restarts=0, scheduling_strategy=strategy
        )
        actor = owner.remote(plan.name, self.work_dir)
        handle = RayHandle(plan.name, actor, self.ray, self.run_dir)
        self.handles.append(handle)
        try:
            where = handle._call("where")
            cpus = self._node_cpus(plan, where)
            listen = (self.spec.listen_host, str(where["address"])) if plan.listens else None
            threads = _torch_threads(plan, len(plan.cpus or []) or num_cpus or 1)
            pid = handle._call(
                "start", plan.args, plan.env, cpus=cpus, threads=threads, listen=listen,
                metrics=plan.metrics,
            )  # fmt: skip
        except (self.ray.exceptions.RayError, TimeoutError, OSError) as e:
            raise LaunchError(f"ray: {plan.name} did not start: {_first_line(e)}") from None
        self.placements.append(
            {"name": plan.name, "bundle": bundle, "cpus": cpus, "pid": pid, **where}
        )
        text = json.dumps(self.placements, indent=2) + "\n"
        (self.run_dir / PLACEMENT_FILE).write_text(text, encoding="utf-8")
        return handle

    def refresh(self, name: str, kind: str = "jsonl") -> None:
        for handle in self.handles:
            if handle.name == name:
                handle.pull(kind)

    def collect(self) -> None:
        for handle in self.handles:
            for kind in ("out", "log", "jsonl"):
                handle.pull(kind)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        from ray.util.placement_group import remove_placement_group

        try:
            self.stop_all(grace_s=5.0)
            self.collect()
        finally:
            for handle in self.handles:
                handle.release()
            remove_placement_group(self.group)


class RayLauncher(Launcher):
    """See the module docstring.

    Args:
        spec: the ``[ray]`` table.
        total_cpus: CPUs per configuration (``resources.total_cpus``).
        baseline: whether the sweep runs the baseline (a node must have ``total_cpus``).
    """

    name = "ray"

    def __init__(self, spec: RaySpec, total_cpus: int, *, baseline: bool):
        self.spec, self.total_cpus, self.baseline = spec, total_cpus, baseline
        self.sweep_tag = f"sweep-{uuid.uuid4().hex[:12]}"
        self.ray: Any = None
        self.owner_class: Any = None  # ProcessOwner as a Ray actor class

    def check(self) -> None:
        """Connect to the cluster; it must have a node for the baseline.

        Raises:
            LaunchError: Ray is missing, the cluster unreachable or too small.
        """
        ray = import_ray()
        try:
            ray.init(address=self.spec.address, logging_level=logging.WARNING, log_to_driver=False)
        except Exception as e:  # ray raises ConnectionError, RuntimeError, ValueError, ...
            raise LaunchError(
                f"ray.address: cannot join the Ray cluster at {self.spec.address!r}: "
                f"{_first_line(e)} (is Ray running there, with this machine's auth token?)"
            ) from None
        self.ray, self.owner_class = ray, ray.remote(ProcessOwner)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        largest = max((n.get("Resources", {}).get("CPU", 0) for n in nodes), default=0)
        if self.baseline and largest < self.total_cpus:
            self.close()
            raise LaunchError(
                f"resources.total_cpus: the baseline needs one node with {self.total_cpus} CPUs; "
                f"the Ray cluster's largest has {largest:g} (lower it, or set baseline = false)"
            )

    def open_session(self, run_dir: Path, num_peers: int) -> RaySession:
        return RaySession(run_dir, self, num_peers)

    def close(self) -> None:
        if self.ray is not None:
            self.ray.shutdown()
            self.ray = None
