"""python -m lorakit.engine.agent FAILURES [TORCHRUN ARGS...]: torchrun (torch.distributed.run, the same
arguments) that, when workers fail, writes how each failed rank ended as JSON to FAILURES instead of its
own multi-line failure report; the launcher (api._launch_workers) turns that and the workers' exit.json into
one line naming the root cause (launch.root_cause_line).

torchrun's agent stops every other worker as soon as one ends with an error; what it knows then is each
failed rank's exit code (negative: the signal that killed it) and whether the rank left an error file
(TORCHELASTIC_ERROR_FILE, which lorakit's workers write when they stop on an error: launch.report_to_agent).
A rank with a failure and no error file died without Python's error handling: a signal (SIGKILL from the
out-of-memory killer), os._exit, a crash in native code.

A stop request (SIGTERM: preemption, Ctrl-C's forward, scancel) is no failure: torchrun hands it to the
workers, which checkpoint and record it (exit.json, exit 75), and its agent then raises SignalException out
of run(). Here that ends the agent with 128 + the signal and nothing printed: no traceback, and none of
torchrun's "death signal" / "closing signal" warnings; the launcher prints lorakit's one line.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

# What torchrun's agent logs (WARNING) on its way through a stop request, by the logger that says it.
_STOP_CHATTER = {
    "torch.distributed.elastic.agent.server.api": ("death signal", "Got termination signal"),
    "torch.distributed.elastic.multiprocessing.api": ("closing signal",),
}


class DropMessages(logging.Filter):
    """Drops a logger's records whose message contains one of `needles`."""

    def __init__(self, needles: tuple[str, ...]):
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(n in record.getMessage() for n in self.needles)


def drop_messages(table: dict[str, tuple[str, ...]]) -> None:
    """Filter each named logger's messages that contain one of its needles; a filter on the logger outlives
    the library's own setup of it (DeepSpeed sets its level and handler when it is imported, later)."""
    for name, needles in table.items():
        logging.getLogger(name).addFilter(DropMessages(needles))


def quiet_stop_requests() -> None:
    """Keep torchrun's agent from logging a stop request it is handing on (the workers' checkpoint and the
    launcher's line say what happened); every other warning and error of the agent still shows."""
    drop_messages(_STOP_CHATTER)


def main(argv: list[str]) -> int:
    """Run torchrun with `argv[1:]`; on a worker failure write FAILURES (`argv[0]`) and return 1; on a stop
    request return 128 + its signal number, silently."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    failures, args = Path(argv[0]), argv[1:]
    quiet_stop_requests()
    try:
        run(parse_args(args))
    except ChildFailedError as e:
        ranks = {
            str(rank): {
                "exitcode": f.exitcode,
                "signal": f.signal_name() if f.exitcode < 0 else None,
                "reported": Path(f.error_file).is_file(),
                "timestamp": f.timestamp,
            }
            for rank, f in e.failures.items()
        }
        failures.write_text(json.dumps(ranks))
        return 1
    except SignalException as e:
        # The workers were stopped with the same signal and given torchrun's shutdown timeout to checkpoint.
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
