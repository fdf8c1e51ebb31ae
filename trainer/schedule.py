"""When the elastic trainer injects its failures: the fault schedule (no JAX, no I/O)."""

from __future__ import annotations

import time
from collections.abc import Sequence


class FaultSchedule:
    """Host losses at given steps or every so many seconds, slice losses at given
    steps, and when a lost slice comes back. Only the training loop's thread uses it."""

    def __init__(self, *, host_loss_at: Sequence[int] = (), host_loss_every_s: float = 0.0,
                 slice_loss_at: Sequence[int] = (), slice_down_steps: int = 25,
                 steps: int) -> None:
        self.host_losses = sorted(host_loss_at)
        self.host_loss_every_s = host_loss_every_s
        self.slice_losses = sorted(slice_loss_at)
        self.slice_down_steps = slice_down_steps
        self.steps = steps
        self.t_last_fault: float | None = None  # the last failure injected (or first step)
        # The slice a slice loss took, until ``slice_down_steps`` steps ran without it.
        self.slice_down: int | None = None
        self.resized_steps = 0  # steps run on fewer slices since the last slice loss

    def host_loss_due(self, step: int) -> bool:
        """Whether to lose the host now: ``step`` reached the next of the host-loss
        steps, or ``host_loss_every_s`` passed since the last failure (or the first
        step). Never at the last step: nothing would be left to recover into (and
        the run's final wait cannot ask the lost host)."""
        if step >= self.steps:
            return False
        if self.host_losses and step >= self.host_losses[0]:
            return True
        every = self.host_loss_every_s
        return every > 0 and self.t_last_fault is not None \
            and time.time() - self.t_last_fault >= every

    def host_lost(self, step: int) -> None:
        """A host loss was injected after ``step``."""
        if self.host_losses and step >= self.host_losses[0]:
            self.host_losses.pop(0)
        self.t_last_fault = time.time()

    def slice_loss_due(self, step: int) -> bool:
        """Whether ``step`` reached the next slice loss (the caller checks that
        training runs on every slice with no recovery pending)."""
        return bool(self.slice_losses) and step >= self.slice_losses[0]

    def slice_lost(self, slice_: int) -> None:
        self.slice_losses.pop(0)
        self.slice_down = slice_
        self.resized_steps = 0
        self.t_last_fault = time.time()

    def slice_to_bring_back(self) -> int | None:
        """The slice a slice loss took, once ``slice_down_steps`` steps ran on the
        survivors (then None again). Never a slice missing for a lost host: its
        replacement is on its way, and bringing all its hosts back would start
        second processes beside the live ones (their address taken, the live
        ones orphaned, the cluster file naming the failed new ones)."""
        s = self.slice_down
        if s is None or self.resized_steps < self.slice_down_steps:
            return None
        self.slice_down = None
        return s

    def stepped(self) -> None:
        """A step completed: the first starts the clock of ``host_loss_every_s``."""
        if self.t_last_fault is None:
            self.t_last_fault = time.time()
