"""The time budget (``training.time_budget``): the training clock every rank agrees on, and progress.

    clock = TrainClock(spent_s)          # a resumed run goes on from its checkpoint's train_seconds
    clock.start()                        # the training loop begins
    with clock.paused(): ...             # a checkpoint save, a held-out decode: not training time
    spent = clock.agree(d)               # collective: the slowest rank's reading, now on every rank
    p = budget_progress(spent, budget_s, steps_done=s, total_steps=N)

What the clock counts: wall time inside the training loop (captures, forward, backward, optimizer
updates and every wait between them) plus what the checkpoint it resumed from had counted. Not
counted: start-up (target load, prompt cache, resume, and a fresh run's first optimizer step,
which compiles with ``training.compile`` and warms the kernels: minutes on a GPU, the same for
any budget), checkpoint saves and held-out decodes. Its samples are trained and counted. So a
process trains for the budget and lives for budget + start-up + saves + held-out decodes + at
most one optimizer step.

Why the ranks agree: whether to stop and the next learning rate must be the same on every rank
(a rank that stopped alone would leave the others waiting in a collective). Once per optimizer
step, just before the update, every rank takes the largest reading; the trainer uses that figure
for the schedule, the stop and the checkpoint. Wall time is not reproducible, so neither is a
budgeted run: the same config trains a different number of steps with slightly different rates
from run to run. Without a budget no collective is added and the schedule follows steps.
"""

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from specforge_core.system.distributed import Dist, all_reduce


def budget_progress(spent_s: float, budget_s: float, *, steps_done: int, total_steps: int) -> float:
    """The run's progress in [0, 1]: the larger of the budget's fraction spent and the plan's horizon
    fraction trained, so the schedule ends at whichever limit comes first (the horizon caps a budget)."""
    return min(1.0, max(spent_s / budget_s, steps_done / total_steps))


class TrainClock:
    """Seconds of training: counts while running, not while :meth:`paused`; starts stopped.

    ``now`` is the clock it reads (seconds, monotonic); tests pass their own.
    """

    def __init__(self, spent_s: float = 0.0, now: Callable[[], float] = time.perf_counter):
        self._base = float(spent_s)
        self._now = now
        self._since: float | None = None  # now() when it last (re)started; None: stopped

    def start(self) -> None:
        self._since = self._now()

    def read(self) -> float:
        """Seconds counted so far (this rank's own reading)."""
        running = 0.0 if self._since is None else self._now() - self._since
        return self._base + running

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Stop counting for the ``with`` block (then go on, if it was running)."""
        was_running = self._since is not None
        self._base, self._since = self.read(), None
        try:
            yield
        finally:
            if was_running:
                self.start()

    def agree(self, d: Dist) -> float:
        """Collective: set every rank's clock to the largest reading and return it."""
        spent = all_reduce(d, [self.read()], op="max")[0]
        self._base = spent
        if self._since is not None:
            self.start()
        return spent
