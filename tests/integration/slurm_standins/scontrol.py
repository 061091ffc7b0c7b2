"""A stand-in for Slurm's scontrol, for tests: `show hostnames LIST` prints the comma-separated names of
LIST one per line (no bracket ranges); `requeue JOBID` appends "requeue JOBID" to the file named by
SLURM_STANDIN_RECORD, where a test reads what the job asked of Slurm. Run with `python -I`."""

import os
import sys


def main(argv: list[str]) -> int:
    if argv[:2] == ["show", "hostnames"]:
        print("\n".join(n for n in argv[2].split(",") if n))
        return 0
    if argv[:1] == ["requeue"]:
        with open(os.environ["SLURM_STANDIN_RECORD"], "a") as f:
            f.write(f"requeue {argv[1]}\n")
        return 0
    print(f"scontrol stand-in: unsupported: {' '.join(argv)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
