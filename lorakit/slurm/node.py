"""python -m lorakit.slurm.node --nodes N --gpus-per-node G --rendezvous HOST:PORT --logs DIR -- RECIPE [K=V ...]:
the launcher of one node in the Slurm job lorakit.slurm writes (srun starts one per node).

It runs torchrun (through lorakit.engine.agent, which records how failed ranks ended) with this node's rank
(SLURM_NODEID) and the job's rendezvous, `python -m lorakit.run RECIPE` in each of its G processes, every
rank's output teed to DIR/node-<host>/ as well as to this node's log. Stop requests: Slurm's notice arrives
as SIGUSR1 at every process of the step (srun hands it on); this launcher asks torchrun to stop once, with
SIGTERM, and torchrun is started ignoring SIGUSR1 (it would die of it and orphan its ranks). The ranks save
a checkpoint and exit 75. This process waits for torchrun to the end, so Slurm never ends the step while a
rank is still writing.

Exit code: 0, or lorakit's (exit.json in output.dir: 75 preempted, 4 diverged, ...), or torchrun's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

# Slurm's SIGUSR1 (the time limit's notice), SIGTERM (preemption, scancel): both ask the run to stop.
STOP = (signal.SIGUSR1, signal.SIGTERM)


def parser() -> argparse.ArgumentParser:
    """The command's arguments."""
    p = argparse.ArgumentParser(prog="python -m lorakit.slurm.node", description=__doc__)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--rendezvous", required=True, help="HOST:PORT of node 0")
    p.add_argument("--logs", required=True, help="this attempt's log folder")
    p.add_argument("--stop-timeout", type=int, default=30,
                   help="seconds torchrun gives the ranks to checkpoint after a stop request")  # fmt: skip
    p.add_argument("lorakit_args", nargs=argparse.REMAINDER, help="-- RECIPE [KEY=VALUE ...]")
    return p


def torchrun(args: argparse.Namespace, node: int, host: str, logs: Path, job: str) -> list[str]:
    """The agent's command line for this node; `job` names the rank logs' folder (torchrun's run id)."""
    head, _, port = args.rendezvous.rpartition(":")
    run_args = [a for a in args.lorakit_args if a != "--"]
    return [
        sys.executable, "-m", "lorakit.engine.agent", str(logs / f"failures-node{node}.json"),
        f"--nnodes={args.nodes}", f"--nproc-per-node={args.gpus_per_node}", f"--node-rank={node}",
        f"--master-addr={head}", f"--master-port={port}", f"--rdzv-id=job-{job}",
        f"--log-dir={logs / f'node-{host}'}", "--tee=3",
        f"--shutdown-timeout={args.stop_timeout}",
        "-m", "lorakit.run", *run_args,
    ]  # fmt: skip


def run_dir_of(run_args: list[str]) -> Path | None:
    """output.dir from the overrides (the Slurm script always passes it, absolute)."""
    found = [a.split("=", 1)[1] for a in run_args if a.startswith("output.dir=")]
    return Path(found[-1]) if found else None


def verdict(code: int, run_dir: Path | None, failures: Path) -> int:
    """This node's exit code: 0, lorakit's from exit.json, else torchrun's; prints the root cause line when a
    rank died without an error of its own."""
    from lorakit.engine.launch import root_cause_line

    if code == 0:
        return 0
    path = run_dir / "exit.json" if run_dir is not None else None
    info = json.loads(path.read_text()) if path is not None and path.is_file() else None
    ranks = json.loads(failures.read_text()) if failures.is_file() else {}
    line = root_cause_line(info, ranks)
    if line is not None:
        print(f"error: {line}", file=sys.stderr, flush=True)
        return 1
    return int(info["code"]) if info else code


def launch(cmd: list[str], env: Mapping[str, str]) -> int:
    """Run the agent; pass the first stop request on to it as SIGTERM; wait for it to end."""
    asked = []

    def forward(signum, frame):
        if asked:  # torchrun restarts its graceful wait on a second SIGTERM: one is enough
            return
        asked.append(signum)
        print(f"lorakit.slurm.node: {signal.Signals(signum).name}: asking the ranks to checkpoint and stop",
              flush=True)  # fmt: skip
        proc.send_signal(signal.SIGTERM)

    # SIG_IGN survives exec: torchrun starts ignoring SIGUSR1 (lorakit's ranks install their own handler).
    previous = {sig: signal.getsignal(sig) for sig in STOP}
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        proc = subprocess.Popen(cmd, env=dict(env))
    finally:
        for sig in STOP:
            signal.signal(sig, forward)
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m lorakit.slurm.node` (run by srun on every node)."""
    from lorakit.engine.launch import launch_env

    args = parser().parse_args(argv)
    node = int(os.environ.get("SLURM_NODEID", "0"))
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    cmd = torchrun(args, node, host, logs, os.environ.get("SLURM_JOB_ID", "0"))
    print(f"lorakit.slurm.node: node {node} ({host}): {' '.join(cmd[1:])}", flush=True)
    code = launch(cmd, launch_env())
    run_args = [a for a in args.lorakit_args if a != "--"]
    return verdict(code, run_dir_of(run_args), logs / f"failures-node{node}.json")


if __name__ == "__main__":
    sys.exit(main())
