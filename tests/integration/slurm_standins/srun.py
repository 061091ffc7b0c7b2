"""A stand-in for Slurm's srun on one machine, for tests: runs the command once per "node" of
SLURM_JOB_NODELIST (comma-separated names, all on this machine) with the variables srun gives a task
(SLURM_NODEID, SLURM_PROCID, SLURM_LOCALID, SLURMD_NODENAME, SLURM_NTASKS). Supports what lorakit's job
script uses: --ntasks-per-node=1, --output (with %N, %n, %t, %j), --label, --kill-on-bad-exit.

Signals as srun and slurmstepd treat them: SIGUSR1, SIGUSR2, SIGINT and SIGCONT reach every process of every
task (slurmstepd signals the step's whole process tree); SIGTERM makes srun kill the step (SIGKILL), as the
real one does ("srun: forcing job termination"). The exit code is the highest of the tasks' (128 + signal
for a task killed by one). Run with `python -I` so that nothing but the standard library is loaded.
"""

import os
import signal
import subprocess
import sys
import threading
import time


def descendants(root: int) -> list[int]:
    """`root` and every process below it, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def signal_tree(root: int, sig: int) -> None:
    for pid in descendants(root):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def main(argv: list[str]) -> int:
    opts, i = {}, 0
    while i < len(argv) and argv[i].startswith("--"):
        key, eq, value = argv[i][2:].partition("=")
        opts[key] = value if eq else "1"
        i += 1
    cmd = argv[i:]
    if opts.get("ntasks-per-node", "1") != "1":
        sys.exit("srun stand-in: only --ntasks-per-node=1")
    nodes = [n for n in os.environ["SLURM_JOB_NODELIST"].split(",") if n]
    procs = []
    for n, host in enumerate(nodes):
        env = {**os.environ, "SLURM_NODEID": str(n), "SLURM_PROCID": str(n), "SLURM_LOCALID": "0",
               "SLURMD_NODENAME": host, "SLURM_NTASKS": str(len(nodes))}  # fmt: skip
        out = opts.get("output")
        if out:
            path = out.replace("%N", host).replace("%n", str(n)).replace("%t", str(n))
            path = path.replace("%j", os.environ.get("SLURM_JOB_ID", "0"))
            stdout = open(path, "a")
        else:
            stdout = subprocess.PIPE
        p = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)  # fmt: skip
        procs.append(p)
        if not out:
            prefix = f"{n}: " if "label" in opts else ""
            threading.Thread(target=_copy, args=(p.stdout, prefix), daemon=True).start()

    def forward(signum, frame):
        for p in procs:
            signal_tree(p.pid, signum)

    def force(signum, frame):
        print("srun: forcing job termination", file=sys.stderr, flush=True)
        for p in procs:
            signal_tree(p.pid, signal.SIGKILL)

    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT, signal.SIGCONT):
        signal.signal(sig, forward)
    signal.signal(signal.SIGTERM, force)
    codes: dict[int, int] = {}
    while len(codes) < len(procs):
        for k, p in enumerate(procs):
            if k not in codes and p.poll() is not None:
                codes[k] = p.returncode if p.returncode >= 0 else 128 - p.returncode
                if codes[k] != 0 and opts.get("kill-on-bad-exit") == "1":
                    print(f"srun: error: task {k}: exited with exit code {codes[k]}; killing the step",
                          file=sys.stderr, flush=True)  # fmt: skip
                    for q in procs:
                        if q.poll() is None:
                            signal_tree(q.pid, signal.SIGKILL)
        time.sleep(0.05)
    time.sleep(0.2)  # the label threads' last lines
    return max(codes.values())


def _copy(stream, prefix: str) -> None:
    for line in stream:
        sys.stdout.write(prefix + line)
        sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
