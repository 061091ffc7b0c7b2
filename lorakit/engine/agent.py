"""python -m lorakit.engine.agent FAILURES [TORCHRUN ARGS...]: torchrun (torch.distributed.run, the same
arguments) that, when workers fail, writes how each failed rank ended as JSON to FAILURES instead of its
own multi-line failure report; the launcher (api._launch_workers) turns that and the workers' exit.json into
one line naming the root cause (launch.root_cause_line).

torchrun's agent stops every other worker as soon as one ends with an error; what it knows then is each
failed rank's exit code (negative: the signal that killed it) and whether the rank left an error file
(TORCHELASTIC_ERROR_FILE, which lorakit's workers write when they stop on an error: launch.report_to_agent).
A rank with a failure and no error file died without Python's error handling: a signal (SIGKILL from the
out-of-memory killer), os._exit, a crash in native code.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    """Run torchrun with `argv[1:]`; on a worker failure write FAILURES (`argv[0]`) and return 1."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    failures, args = Path(argv[0]), argv[1:]
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
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
