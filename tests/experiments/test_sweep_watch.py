"""The sweep's dashboard injection point, with a launcher whose processes end at once: which
configurations ask for a dashboard, with what, when it is open, and how q and refusals act."""

from __future__ import annotations

import io
import tomllib
from contextlib import contextmanager
from pathlib import Path

import pytest
from rich.console import Console

from experiments import sweep
from experiments.launch.base import Launcher, ProcessPlan, Session
from experiments.spec import parse_spec
from experiments.watching import WatchTarget, WatchUnavailable
from tests.experiments.helpers import tiny_spec

pytestmark = pytest.mark.timeout(30)


class _Done:
    """A process that has already exited with 0."""

    def __init__(self, name: str):
        self.name = name

    def poll(self) -> int:
        return 0

    def terminate(self) -> None:
        pass

    def kill(self) -> None:
        pass


class _FakeSession(Session):
    def __init__(self, run_dir: Path, events: list[str], url: str):
        super().__init__(run_dir)
        self.events, self.url = events, url

    def start(self, plan: ProcessPlan) -> _Done:
        self.events.append(f"start {plan.name}")
        if plan.metrics:
            (self.run_dir / f"{plan.name}.jsonl").write_text("")
        handle = _Done(plan.name)
        self.handles.append(handle)
        return handle

    def start_bootstrap(self, plan: ProcessPlan) -> str:
        self.start(plan)
        return self.url

    def stop_all(self, grace_s: float = 20.0) -> None:
        self.events.append("stop_all")


class _FakeLauncher(Launcher):
    def __init__(self):
        self.events: list[str] = []
        self.num_sessions = 0

    def open_session(self, run_dir: Path, num_peers: int) -> _FakeSession:
        self.num_sessions += 1
        return _FakeSession(run_dir, self.events, f"http://127.0.0.1:{9000 + self.num_sessions}")


class _Recorder:
    """A watch factory that records its targets and when its dashboards are open."""

    def __init__(
        self, events: list[str], *, quit_first: bool = False, refuse: Exception | None = None
    ):
        self.events, self.quit_first, self.refuse = events, quit_first, refuse
        self.targets = []

    def __call__(self, target, on_quit):
        self.targets.append(target)

        @contextmanager
        def shown():
            if self.refuse is not None:
                raise self.refuse
            self.events.append(f"open {target.run_id}")
            if self.quit_first:
                on_quit()  # the user pressed q at once
            try:
                yield
            finally:
                self.events.append(f"close {target.run_id}")

        return shown()


@pytest.fixture
def launcher(monkeypatch) -> _FakeLauncher:
    fake = _FakeLauncher()
    monkeypatch.setattr(sweep, "make_launcher", lambda spec: fake)
    return fake


def _run(tmp_path: Path, watch, backends: str = '["native"]') -> tuple[dict, str]:
    data = tomllib.loads(
        tiny_spec("w", extra=f"[grid]\ntarget_batch_size = [128, 512]\nbackend = {backends}\n")
    )
    spec = parse_spec(data)
    output = io.StringIO()
    console = Console(file=output, width=120)
    outcomes = sweep.run_sweep(spec, "", tmp_path / "out", console=console, watch=watch)
    return outcomes, output.getvalue()


def test_each_swarm_configuration_gets_one_dashboard_and_the_baseline_none(tmp_path, launcher):
    recorder = _Recorder(launcher.events)
    outcomes, _ = _run(tmp_path, recorder)
    assert [o.status for o in outcomes.values()] == ["done", "done", "done"]
    names = list(outcomes)
    assert names[0].startswith("baseline")
    swarm_names = names[1:]
    assert [t.config_name for t in recorder.targets] == swarm_names
    # sessions 2 and 3 are the swarm configurations' (the baseline's came first)
    assert [t.bootstrap_url for t in recorder.targets] == [
        "http://127.0.0.1:9002",
        "http://127.0.0.1:9003",
    ]
    assert [t.run_id for t in recorder.targets] == [f"w-{name}" for name in swarm_names]
    assert [(t.position, t.num_configs) for t in recorder.targets] == [(2, 3), (3, 3)]
    assert [t.target_batch_size for t in recorder.targets] == [128, 512]
    assert {(t.num_peers, t.backend, t.launcher) for t in recorder.targets} == {
        (2, "native", "local")
    }
    assert recorder.targets[0].label == f"config 2/3: {swarm_names[0]}"
    assert recorder.targets[0].enter_network is None  # the host reaches loopback
    # open once the bootstrap is up, before the peers start; closed before they are stopped
    run_id = recorder.targets[0].run_id
    events = launcher.events
    start = events.index("start dht", events.index("stop_all"))  # after the baseline's stop
    assert events[start : start + 6] == [
        "start dht",
        f"open {run_id}",
        "start peer-0",
        "start peer-1",
        f"close {run_id}",
        "stop_all",
    ]


def test_q_closes_the_dashboard_for_the_rest_of_the_sweep(tmp_path, launcher):
    recorder = _Recorder(launcher.events, quit_first=True)
    outcomes, text = _run(tmp_path, recorder)
    assert [o.status for o in outcomes.values()] == ["done", "done", "done"]
    assert len(recorder.targets) == 1
    assert "dashboard closed (q)" in text and "Ctrl-C stops the sweep" in text


def test_a_refusal_skips_one_configuration_and_an_error_the_rest(tmp_path, launcher):
    refusing = _Recorder(launcher.events, refuse=WatchUnavailable("hivemind, say"))
    outcomes, text = _run(tmp_path, refusing)
    assert [o.status for o in outcomes.values()] == ["done", "done", "done"]
    assert len(refusing.targets) == 2  # asked again for the next configuration
    assert text.count("no live dashboard: hivemind, say") == 2

    failing = _Recorder(launcher.events, refuse=ConnectionError("unreachable"))
    outcomes, text = _run(tmp_path / "again", failing)
    assert [o.status for o in outcomes.values()] == ["done", "done", "done"]
    assert len(failing.targets) == 1
    assert "live dashboard off for the rest of the sweep: unreachable" in text


def test_the_peer_cli_has_no_hivemind_reader_inside_namespaces():
    from peer.cli.experiment import watch_configuration

    target = WatchTarget(
        run_id="w-x", bootstrap_url="/ip4/10.213.0.1/tcp/1/p2p/Qm", config_name="x",
        position=1, num_configs=1, num_peers=2, target_batch_size=256, backend="hivemind",
        launcher="netns", enter_network=lambda: None,
    )  # fmt: skip
    with pytest.raises(WatchUnavailable, match="hivemind swarm in network namespaces"):
        with watch_configuration(target, lambda: None):
            pass


def test_without_a_factory_nothing_is_asked(tmp_path, launcher):
    outcomes, text = _run(tmp_path, None)
    assert [o.status for o in outcomes.values()] == ["done", "done", "done"]
    assert "dashboard" not in text
