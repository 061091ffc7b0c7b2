"""Preemption: SIGTERM or SIGUSR1 asks the run to stop after the current step with a checkpoint."""

from __future__ import annotations

import signal
import threading

# SIGTERM: what Kubernetes, Slurm (scancel, time limits) and torchrun send to end a job.
# SIGUSR1: what Slurm sends ahead of a time limit with `#SBATCH --signal=USR1@SECONDS`.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequests:
    """Installs handlers that note a stop request; `received_here()` is this rank's flag, which the loop
    shares with every rank on each step's closing all_reduce.

    A context manager: the previous handlers come back on exit. Outside the main thread (where Python
    cannot install handlers) it never reports a request.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _note(self, signum, frame) -> None:
        # Only a flag: the step in flight finishes, then every rank stops at the same step boundary.
        self.received = signum

    def received_here(self) -> bool:
        """Whether this rank was asked to stop (not collective): the loop shares it on the all_reduce that
        ends each step (engine/loop.train_window), so asking costs no collective of its own."""
        return self.received is not None
