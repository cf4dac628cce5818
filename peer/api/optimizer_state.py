"""The state side of :class:`peer.Optimizer`: loading the swarm's state, state dicts, and the
scheduler that follows the epoch (the optimizer's own module holds the training loop side)."""

from __future__ import annotations

from typing import Any


class OptimizerState:
    """Methods of :class:`peer.Optimizer` about its state (a base class of it; it reads the
    optimizer's ``opt``, ``session``, ``scheduler`` and ``local_epoch``)."""

    def load_state_from_peers(self) -> bool:
        """Download the newest state of the run (parameters, optimizer state, epoch) from a
        peer that serves it; this peer's progress in the current epoch is discarded.

        Returns:
            Whether a state was loaded (False when no peer delivered one in time).
        """
        swarm = self.session.refresh()
        return self._jump(max(swarm.epoch, self.local_epoch), mode="download")

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict with ``state["local_epoch"]`` (as hivemind's)."""
        state = self.opt.state_dict()
        state["state"]["local_epoch"] = self.local_epoch
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (the epoch too, when it holds one)."""
        state = dict(state_dict, state=dict(state_dict["state"]))
        epoch = state["state"].pop("local_epoch", None)
        self.opt.load_state_dict(state)
        if epoch is not None and epoch != self.local_epoch:
            self._jump(int(epoch), mode="forced")

    def _jump(self, epoch: int, *, mode: str) -> bool:
        """Enter a state from outside a round: downloaded now (``download``: the state of
        ``epoch`` or later), or just loaded from a state dict (``forced``: its ``epoch``).
        Whether a state was loaded; the LR came with it, so the scheduler follows."""
        hook = self._hook
        hook.flush()
        if mode == "download":
            reached = self.session.download(epoch, fallback=epoch - 1)
            if reached < epoch:
                return False  # nothing was loaded: this peer stays where it was
            epoch = reached
        hook.jump_to(epoch)
        self._downloaded = True
        self._sync_scheduler()
        return True

    def _on_behind(self, swarm_epoch: int) -> int:
        """The swarm is ahead: the collaborative optimizer's catch-up (a download)."""
        epoch = self._hook.epoch
        reached = self.session.catch_up(swarm_epoch, epoch=epoch)
        self._downloaded = self._downloaded or reached > epoch
        return reached

    def _sync_scheduler(self) -> None:
        """Step the scheduler once per epoch; after a download the LR came with the state."""
        if self.scheduler is None or self.local_epoch == self._scheduler_epoch:
            return
        if self._downloaded or self.local_epoch < self._scheduler_epoch:
            self.scheduler.last_epoch = self.local_epoch
            self._downloaded = False
        else:
            for _ in range(self.local_epoch - self._scheduler_epoch):
                self.scheduler.step()
        self._scheduler_epoch = self.local_epoch
