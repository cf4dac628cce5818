"""``peer.Optimizer``: a drop-in for ``hivemind.Optimizer`` in any PyTorch training loop.

It composes what ``peer join`` runs (:mod:`peer.run.runner`): the swarm services attached to the
user's :class:`peer.DHT`, the collaborative optimizer as the step hook (called from
:meth:`Optimizer.step` instead of from our trainer), state catch-up, the profiler with its DHT
record, trace and exit table, the round record the dashboard reads, and the metrics stream.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from dht.identity import short_id
from peer.api.dht import DHT
from peer.api.optimizer_state import OptimizerState
from peer.api.options import (
    check_arguments,
    log_to_stderr,
    make_optimizer,
    make_scheduler,
    positive,
)
from peer.api.profile import LoopPhases, set_active
from peer.api.session import Session
from peer.api.swarm import LoopCounts, state_module
from peer.train.device import Amp
from peer.train.trainer import StepContext

logger = logging.getLogger(__name__)
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


class Optimizer(OptimizerState, torch.optim.Optimizer):
    """Wraps a PyTorch optimizer; turns local steps into swarm epochs (see docs/API.md).

    As ``hivemind.Optimizer``, it is a ``torch.optim.Optimizer`` whose ``param_groups`` and
    ``state`` are the wrapped optimizer's, so code that takes a PyTorch optimizer (an LR
    scheduler, a framework calling ``step(closure)`` and ``zero_grad()``) takes it.

    Like ``hivemind.Optimizer``: each :meth:`step` reports ``batch_size_per_step`` samples;
    once the swarm has processed ``target_batch_size`` samples in total, the peers average and
    the epoch advances (``local_epoch``). Call :meth:`zero_grad` as usual.

    Args:
        dht: a running :class:`peer.DHT`.
        run_id: the training run; every peer with the same run id trains together.
        target_batch_size: samples the swarm gathers per epoch (one global step).
        batch_size_per_step: samples behind each :meth:`step` (or pass ``batch_size``).
        optimizer: a ``torch.optim.Optimizer``, or a factory ``params -> optimizer``.
        params: parameters or param groups for the factory (with an instance: omit).
        scheduler: an LR scheduler or a factory ``optimizer -> scheduler``; it steps once per
            swarm epoch (never per local step), so peers that join late agree on the LR.
        matchmaking_time: most seconds to look for a group at an epoch boundary (less once
            the averager measured how long partners take to arrive).
        averaging_timeout: seconds for the all-reduce of one round.
        load_state_timeout: seconds for one download of the swarm's state.
        reuse_grad_buffers: accumulate straight into ``.grad`` (grad mode; saves a pass per
            step); then never call :meth:`zero_grad` and keep the batch size constant.
        delay_optimizer_step: overlap each round and its optimizer step with the next epoch's
            compute (grad mode; at most one step of staleness: delayed parameter updates).
        use_local_updates: step the optimizer on every local batch and average the parameters
            at each epoch boundary (``mode="params"``).
        client_mode: must match the DHT's (None: the DHT's).
        grad_compression: ``"none"``, ``"fp16"``, ``"uint8"`` or a hivemind compression object.
        state_averaging_compression: must equal ``grad_compression`` (one wire format).
        load_state_compression: ``"none"`` or ``"bf16"`` for state downloads.
        shutdown_timeout: seconds :meth:`shutdown` waits for each part to leave.
        verbose: log one line per epoch (group size, loss) at INFO.
        mode: ``"grad"`` (default), ``"params"`` or ``"diloco"`` (inner ``optimizer`` steps
            locally; an outer Nesterov SGD applies the averaged pseudo-gradient each epoch).
        outer_lr: the outer optimizer's learning rate (``diloco``).
        outer_momentum: the outer optimizer's Nesterov momentum (``diloco``).
        model: the module whose trainable parameters are exactly the optimizer's (hivemind
            takes parameters only). Given, the state served to and loaded from other peers is
            its ``state_dict()``: buffers such as BatchNorm's running statistics travel too,
            under the keys a ``peer join`` peer of the same model uses. Default: a module of
            the parameters alone.
        **options: the rest of ``peer join``'s settings that apply to a library peer
            (``diloco_overlap``: with ``mode="diloco"``, each outer round runs in the
            background while the next inner steps go on, its outer step one round late;
            ``target_group_size``, ``min_group_size``, ``newcomer_wait``, ``split_wait``,
            ``min_deadline``, ``publish_interval``, ``wait_for_peers``, ``wait_for_peers_timeout``,
            ``lr_schedule``, ``warmup_epochs``, ``schedule_epochs``, ``min_lr_ratio``,
            ``metrics_file``, ``metrics_interval``, ``trace``, ``trace_max_mb``,
            ``profile_interval``, ``profile_window``), ``summary``
            (print the profiler's table at shutdown; default True) and hivemind's arguments
            that have no equivalent (a value other than their default raises ``TypeError``).

    Raises:
        TypeError: an argument that does not exist here (the message says what to use).
        ValueError: a bad value, naming the argument.
    """

    def __init__(
        self,
        *,
        dht: DHT,
        run_id: str,
        target_batch_size: int,
        batch_size_per_step: int | None = None,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        params: Iterable[Any] | None = None,
        scheduler: Any = None,
        matchmaking_time: float = 5.0,
        averaging_timeout: float = 30.0,
        load_state_timeout: float = 600.0,
        reuse_grad_buffers: bool = False,
        delay_optimizer_step: bool | None = None,
        use_local_updates: bool = False,
        client_mode: bool | None = None,
        grad_compression: Any = None,
        state_averaging_compression: Any = None,
        load_state_compression: Any = None,
        shutdown_timeout: float = 5.0,
        verbose: bool = False,
        mode: str | None = None,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        model: torch.nn.Module | None = None,
        **options: Any,
    ):
        config, summary = check_arguments(
            dht=dht,
            run_id=run_id,
            target_batch_size=target_batch_size,
            batch_size_per_step=batch_size_per_step,
            scheduler=scheduler,
            matchmaking_time=matchmaking_time,
            averaging_timeout=averaging_timeout,
            load_state_timeout=load_state_timeout,
            reuse_grad_buffers=reuse_grad_buffers,
            delay_optimizer_step=delay_optimizer_step,
            use_local_updates=use_local_updates,
            client_mode=client_mode,
            grad_compression=grad_compression,
            state_averaging_compression=state_averaging_compression,
            load_state_compression=load_state_compression,
            shutdown_timeout=shutdown_timeout,
            mode=mode,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            options=options,
        )
        # torch.optim.Optimizer's own __init__ would copy the param groups: the wrapped
        # optimizer keeps them, and only the hook registries of the base class are needed
        for registry in _TORCH_HOOK_REGISTRIES:
            setattr(self, registry, OrderedDict())
        self.dht, self.run_id = dht, run_id
        self.target_batch_size, self.batch_size_per_step = target_batch_size, batch_size_per_step
        self.config, self.verbose, self.summary = config, verbose, summary
        self.shutdown_timeout = shutdown_timeout
        self.opt = make_optimizer(optimizer, params)
        self._params = [p for group in self.opt.param_groups for p in group["params"]]
        self._reuse_grad_buffers = reuse_grad_buffers
        self._amp = Amp(torch.device("cpu"), "off")  # the user's loop owns autocast and scaling
        self._counts = LoopCounts(model=state_module(model, self._params))
        self._last_loss: torch.Tensor | None = None
        self._downloaded = False
        self._epoch_logged = -1
        self._closed = False
        if verbose:
            log_to_stderr()
        self.session = Session(
            config,
            dht=dht,
            optimizer=self.opt,
            counts=self._counts,
            collaborative=dataclasses.replace(
                config.collaborative_config(),
                accumulate_in_grad=reuse_grad_buffers,
                outer_lr=float(outer_lr),
                outer_momentum=float(outer_momentum),
            ),
            on_epoch=self._on_epoch,
            on_behind=self._on_behind,
            last_loss=lambda: self._last_loss,
            process_name=f"peer {short_id(dht.peer_id)}",
        )
        self._hook = self.session.hook
        try:  # the scheduler starts at the epoch reached (the swarm's, after a download)
            self.scheduler = make_scheduler(scheduler, self.opt, self.local_epoch, wrapper=self)
            self._scheduler_epoch = self.local_epoch
            self.loop_phases = LoopPhases(self.session.profiler.clock, self._params)
        except BaseException:
            self.session.close(last_loss=None, summary=False, timeout_s=shutdown_timeout)
            raise
        dht.attached_run = run_id
        set_active(self)

    # ---- the training loop -------------------------------------------------------------------

    def step(
        self,
        closure: Callable[[], torch.Tensor] | None = None,
        batch_size: int | None = None,
        grad_scaler: Any = None,
        *,
        loss: torch.Tensor | float | None = None,
    ) -> torch.Tensor | None:
        """Report one local step's gradients (``batch_size`` samples): accumulate them, step
        locally or average with the swarm, as the mode says.

        Args:
            closure: recomputes the loss (called with grad enabled), as in PyTorch.
            batch_size: samples behind this step (default: ``batch_size_per_step``).
            grad_scaler: not supported (unscale before ``step``; see docs/API.md).
            loss: this step's loss, for the metrics stream, the dashboard and the summary
                (the closure's result when there is one).

        Returns:
            The closure's loss, or None.
        """
        if grad_scaler is not None:
            raise TypeError("step(): grad_scaler is not supported here; unscale_ the gradients")
        if self._closed:
            raise RuntimeError("step() after shutdown()")
        batch_size = batch_size if batch_size is not None else self.batch_size_per_step
        positive("batch_size", batch_size, integer=True)
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.loop_phases.switch("optimizer")
        try:
            self._step(batch_size, loss)
        finally:
            self.loop_phases.after_step()
        return loss if closure is not None else None

    def _step(self, batch_size: int, loss: Any) -> None:
        if isinstance(loss, torch.Tensor):
            self._last_loss = loss.detach()
        elif loss is not None:
            self._last_loss = torch.tensor(float(loss))
        counts = self._counts
        counts.step += 1
        counts.total_samples += batch_size
        if self._reuse_grad_buffers:
            self._hook.backward_weight(batch_size)  # fixes the unit: the first batch's size
            if batch_size != self._hook.contribution.sample_unit:
                raise ValueError("batch_size: must stay the same with reuse_grad_buffers")
        self._hook.on_step(
            StepContext(
                step=counts.step,
                batch_samples=batch_size,
                loss=self._last_loss if self._last_loss is not None else _NO_LOSS,
                model=counts.model,
                optimizer=self.opt,
                amp=self._amp,
                clock=self.session.profiler.clock,
            )
        )
        self.session.after_step(batch_size, self._last_loss)
        self._sync_scheduler()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the parameters' gradients (as ``torch.optim.Optimizer.zero_grad``).

        Raises:
            ValueError: with ``reuse_grad_buffers=True``, where ``.grad`` holds the swarm's
                accumulated gradients.
        """
        if self._reuse_grad_buffers:
            raise ValueError(
                "zero_grad(): with reuse_grad_buffers=True the gradients are the accumulators; "
                "do not zero them"
            )
        for param in self._params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.detach_().zero_()

    @property
    def local_epoch(self) -> int:
        """This peer's epoch: swarm epochs completed (it follows the swarm's)."""
        return self._hook.epoch

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The wrapped optimizer's param groups (LR changes apply to it)."""
        return self.opt.param_groups

    @property
    def state(self):  # type: ignore[override]
        """The wrapped optimizer's per-parameter state."""
        return self.opt.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's defaults."""
        return self.opt.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported: every peer of a run must average the same tensors.

        Raises:
            ValueError: always.
        """
        raise ValueError("add_param_group: give every parameter group at construction")

    @property
    def use_local_updates(self) -> bool:
        """Whether the optimizer steps on every local batch (``mode="params"``), as hivemind's."""
        return self.config.mode == "params"

    @property
    def use_gradient_averaging(self) -> bool:
        """Whether gradients are averaged (``mode="grad"``), as hivemind's."""
        return self.config.mode == "grad"

    @property
    def stats(self):
        """Counters of finished rounds (:class:`peer.swarm.round.EpochStats`)."""
        return self._hook.stats

    def is_synchronized_with_peers(self) -> bool:
        """Whether this peer is at most one epoch behind the swarm."""
        return self.local_epoch >= self.session.services.tracker.current().epoch - 1

    def is_alive(self) -> bool:
        """Whether the optimizer still takes part in the swarm (not shut down)."""
        return not self._closed

    def _on_epoch(self, epoch: int) -> None:
        if self.verbose and epoch != self._epoch_logged:
            self._epoch_logged = epoch
            stats = self._hook.stats
            logger.info(
                "epoch %d: averaged with %d peer(s) (%s)",
                epoch,
                stats.last_group_size,
                (stats.history[-1].reason if stats.history else "") or "ok",
            )

    # ---- leaving -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Finish a round still in flight, stop publishing, leave the swarm (the DHT stays up:
        it is the caller's); print the profiler's table unless ``summary=False``. Safe twice."""
        if self._closed:
            return
        self._closed = True
        set_active(None)
        self.dht.attached_run = None
        self.loop_phases.close()
        self.session.close(
            last_loss=self._last_loss, summary=self.summary, timeout_s=self.shutdown_timeout
        )

    def __enter__(self) -> Optimizer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"peer.Optimizer(run_id={self.run_id!r}, epoch={self.local_epoch})"


_NO_LOSS = torch.zeros(())
_TORCH_HOOK_REGISTRIES = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)
