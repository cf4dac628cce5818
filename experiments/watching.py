"""What a sweep shows while it runs: a progress bar over the configurations and, when the command
line injects one (a terminal), a live dashboard of the running swarm configuration.

``experiments`` may not import ``monitor``: the dashboard comes in as a :data:`Watch` factory
from the composition root (``peer/cli/experiment.py``). :class:`SweepScreen` owns both
views: the progress bar is paused while a dashboard is up (the dashboard's footer shows the
sweep position instead) and comes back when the configuration ends. ``q`` closes the dashboard
for the rest of the sweep and leaves the sweep running (the results are not touched); Ctrl-C
stops the sweep as without a dashboard.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@dataclasses.dataclass(frozen=True, kw_only=True)
class WatchTarget:
    """The running swarm configuration, as a dashboard needs it.

    Attributes:
        run_id: the DHT run id of its peers (``<spec name>-<config name>``).
        bootstrap_url: the address its peers joined through (``--initial-peers``).
        config_name: the configuration's directory name.
        position: its place in the sweep, from 1.
        num_configs: configurations in the sweep.
        num_peers: peers it runs.
        target_batch_size: samples per swarm epoch.
        backend: ``native`` or ``hivemind``.
        launcher: ``local``, ``netns``, ``ssh`` or ``ray``.
        enter_network: moves the calling thread into the network the peers live in (netns: the
            hub namespace), so that the sockets it opens afterwards reach them; None when the
            host's own network reaches them.
    """

    run_id: str
    bootstrap_url: str
    config_name: str
    position: int
    num_configs: int
    num_peers: int
    target_batch_size: int
    backend: str
    launcher: str
    enter_network: Callable[[], None] | None = None

    @property
    def label(self) -> str:
        """``config 2/5: <name>``: the sweep position for a footer."""
        return f"config {self.position}/{self.num_configs}: {self.config_name}"


class WatchUnavailable(Exception):
    """A :data:`Watch` factory has no dashboard for this configuration; the message says why."""


# (target, on_quit) -> a context manager that shows the dashboard while it is open. ``on_quit``
# is called (from any thread) when the user closes the dashboard with q. Raising
# WatchUnavailable skips this configuration; any other error turns the dashboard off for the
# rest of the sweep (e.g. the host cannot reach the bootstrap). Neither fails the configuration.
Watch = Callable[[WatchTarget, Callable[[], None]], AbstractContextManager[object]]


def _progress(console: Console, *, transient: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"),
        console=console,
        disable=not console.is_terminal,
        transient=transient,  # paused under a dashboard: leave no copies in the scrollback
    )


class SweepScreen:
    """The sweep's progress bar, and the injected dashboard per configuration.

    Args:
        console: where the progress bar and the sweep's lines go (stderr by default).
        name: the sweep's name.
        num_configs: configurations in the sweep.
        watch: the dashboard factory; None: the progress bar only.
    """

    def __init__(self, console: Console, name: str, num_configs: int, watch: Watch | None = None):
        self.console = console
        self.name = name
        self.watch = watch
        self.progress = _progress(console, transient=watch is not None)
        self._bar = self.progress.add_task(name, total=num_configs, status="")
        self._quit = threading.Event()  # set from the dashboard's thread on q
        self._open: ExitStack | None = None  # the shown dashboard's exit

    def __enter__(self) -> SweepScreen:
        self.progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._close_dashboard()
        self.progress.stop()

    @property
    def live(self) -> bool:
        """Whether the status line is worth computing (a progress bar or a dashboard is up)."""
        return self.console.is_terminal or self.watch is not None

    def begin(self, config_name: str) -> None:
        """A configuration starts."""
        self.progress.update(self._bar, description=f"{self.name}: {config_name}", status="")

    def end(self) -> None:
        """The configuration ended (finished, failed or skipped)."""
        self.progress.advance(self._bar)

    def on_update(self, text: str) -> None:
        """The running configuration's status line; called from the main thread every few
        seconds, which is also where a dashboard closed with q is put away."""
        self.progress.update(self._bar, status=text)
        if self._quit.is_set():
            self._close_dashboard()

    @contextmanager
    def dashboard(self, target: WatchTarget) -> Iterator[None]:
        """Show the injected dashboard of ``target`` until the block ends (nothing if none)."""
        if self.watch is None:
            yield
            return
        self.progress.stop()
        stack = ExitStack()
        try:
            stack.enter_context(self.watch(target, self._quit.set))
        except WatchUnavailable as e:
            self._resume(f"{target.config_name}: no live dashboard: {e}")
        except Exception as e:  # a dashboard must never fail a configuration
            self.watch = None
            self._resume(f"{target.config_name}: live dashboard off for the rest of the sweep: {e}")
        except BaseException:
            self.progress.start()
            raise
        else:
            self._open = stack
        try:
            yield
        finally:
            self._close_dashboard()

    def _resume(self, line: str) -> None:
        self.progress.start()
        self.console.print(line, highlight=False, markup=False)

    def _close_dashboard(self) -> None:
        stack, self._open = self._open, None
        if stack is None:
            return
        try:
            stack.close()
        finally:
            self.progress.start()
        if self._quit.is_set() and self.watch is not None:
            self.watch = None
            self.console.print(
                "dashboard closed (q): the progress bar for the rest of the sweep; "
                "Ctrl-C stops the sweep",
                highlight=False,
            )
