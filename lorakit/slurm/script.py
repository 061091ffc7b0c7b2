"""The sbatch script of a Slurm job for a recipe: its shape (nodes x GPUs per node), the plan for that shape
as comments at its top, a multi-node preflight, one launcher per node, and a requeue on preemption.

`render(job)` is a pure function of the JobSpec; the command line (lorakit.slurm.__main__) builds the spec,
writes the script and submits it. docs/multinode.md#slurm annotates what the script does.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from lorakit.errors import LorakitError

SCRIPT = "job.sbatch"
# EX_TEMPFAIL: lorakit's exit code for "preempted, a checkpoint was saved" (engine/loop.Preempted).
PREEMPTED = 75
# What a failed preflight makes the job exit with: docs/resume.md's "a check failed on this machine".
PREFLIGHT_FAILED = 3
# The rendezvous port: PORT_BASE + job id % PORT_SPAN, all below Linux's ephemeral range (32768-60999 by
# default, net.ipv4.ip_local_port_range), where an outgoing connection on the head node may hold it.
PORT_BASE, PORT_SPAN = 10000, 22000


@dataclass(frozen=True)
class JobSpec:
    """Everything the script says, resolved: absolute paths, the overrides that workers get."""

    recipe: str  # absolute path of the recipe file
    overrides: list[str]  # the user's, then distributed.num_processes and output.dir set by the job
    run_dir: str  # absolute output.dir
    workdir: str  # where relative paths of the recipe were resolved from: the job runs there
    python: str  # the interpreter that runs lorakit on the nodes
    name: str
    nodes: int
    gpus_per_node: int
    # The optional #SBATCH directives given, as (name, value): partition, time, account, cpus-per-task.
    options: tuple[tuple[str, str], ...] = ()
    # #SBATCH --mem: per node, in Slurm's units ("160G"), or "0" for all of each node's memory.
    memory: str = "0"
    memory_note: str = ""  # where the memory request came from, said next to it
    exclusive: bool = False  # #SBATCH --exclusive: whole nodes, shared with no other job
    gres: bool = False  # GPUs as --gres=gpu:G (clusters without select/cons_tres) instead of --gpus-per-node
    stop_before: int = 300  # seconds before the time limit at which Slurm asks the run to stop
    preflight_timeout: int = 30  # seconds each step of the preflight may take
    plan: list[str] = field(default_factory=list)  # the plan's lines, printed as comments
    command: str = ""  # the command that wrote the script


def _q(value: str) -> str:
    """`value` as one bash word on one line: single quotes, or, for a value with a character that is not
    printable (a newline, a tab, a Unicode line separator), ANSI-C quotes with that character as \\xHH bytes,
    so that no value spreads over lines or ends the word."""
    if value.isprintable():
        return shlex.quote(value)
    out = []
    for c in value:
        if c in "\\'":
            out.append("\\" + c)
        elif c.isprintable():
            out.append(c)
        else:
            out.append("".join(f"\\x{b:02x}" for b in c.encode("utf-8", "surrogateescape")))
    return "$'" + "".join(out) + "'"


def comment(text: str) -> str:
    """`text` for a `#` comment line: every character that is not printable written as its escape (\\n,
    \\u2028), so that nothing in it ends the comment."""
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode() for c in text
    )


# What an #SBATCH value may hold unquoted (sbatch splits at whitespace, reads quotes and a `#` comment).
_PLAIN = re.compile(r"[A-Za-z0-9_.,:+/%@=-]+")


def _word(field_name: str, value: str, output: bool = False) -> str:
    """`value` as one argument of an #SBATCH line, which sbatch reads up to whitespace or an unquoted `#`:
    in double quotes, `"` and `\\` escaped. A character that is not printable cannot be written there (a
    newline ends the directive): exit 2 naming the field. In --output, `%%` is a literal `%`."""
    bad = next((c for c in value if not c.isprintable()), None)
    if bad is not None:
        raise LorakitError(f"{field_name}: {value!r} has the character {bad!r}, which an #SBATCH line cannot "
                           "carry: use a value without control characters or line breaks")  # fmt: skip
    if output:
        if "\\" in value:
            raise LorakitError(f"{field_name}: {value!r} has a backslash, which turns off Slurm's %j in "
                               "the job's log name (#SBATCH --output): use a path without one")  # fmt: skip
        value = value.replace("%", "%%")
    if _PLAIN.fullmatch(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def sbatch_lines(job: JobSpec) -> list[str]:
    """The #SBATCH directives (each value quoted for sbatch; one it cannot carry is exit 2 naming it)."""
    g = job.gpus_per_node
    # --gpus-per-node needs select/cons_tres (Slurm 19.05+); --gres=gpu:G works wherever GPUs are a GRES.
    gpus = f"--gres=gpu:{g}" if job.gres else f"--gpus-per-node={g}"
    other = f"# #SBATCH --gpus-per-node={g}  (with select/cons_tres: drop --gres)" if job.gres else (
        f"# #SBATCH --gres=gpu:{g}  (instead of --gpus-per-node, on clusters without select/cons_tres: "
        "python -m lorakit.slurm ... --gres)")  # fmt: skip
    log = _word("output.dir", job.run_dir, output=True)
    log = log[:-1] + '/slurm-%j.out"' if log.endswith('"') else log + "/slurm-%j.out"
    out = [
        f"#SBATCH --job-name={_word('output.dir (the job is named after its folder)', job.name)}",
        f"#SBATCH --nodes={job.nodes}",
        "#SBATCH --ntasks-per-node=1",  # one launcher per node; it starts the node's processes
        f"#SBATCH {gpus}",
        other,
        # The node's memory for its one task (all G processes): without it Slurm gives DefMemPerCPU per CPU
        # and the cgroup kills the job while the weights load.
        f"#SBATCH --mem={_word('--mem', job.memory)}",
        *(["# " + comment(job.memory_note)] if job.memory_note else []),
        *(["#SBATCH --exclusive"] if job.exclusive else []),
        # The job's own log, appended to by every attempt (a requeued job keeps its id).
        f"#SBATCH --output={log}",
        "#SBATCH --open-mode=append",
        # The notice before the time limit: SIGUSR1 to this script, which passes it to every process
        # (see the trap below); lorakit checkpoints at the next step boundary and exits 75.
        f"#SBATCH --signal=B:USR1@{job.stop_before}",
        "#SBATCH --requeue",
    ]
    out += [f"#SBATCH --{k}={_word('--' + k, str(v))}" for k, v in job.options]
    if "cpus-per-task" not in dict(job.options):
        # One task per node runs all G processes: without it, Slurm may give the task a single CPU.
        out.append(f"# #SBATCH --cpus-per-task=...  (CPUs for the node's {g} processes: "
                   "python -m lorakit.slurm ... --cpus-per-task N)")  # fmt: skip
    return out


def render(job: JobSpec) -> str:
    """The whole script: header and plan as comments, directives, then the job's steps."""
    n, g = job.nodes, job.gpus_per_node
    head = [
        "#!/bin/bash",
        "# " + comment(f"lorakit: {job.name} on {n} node(s) x {g} GPU(s) = {n * g} processes"),
        "# written by: " + comment(job.command) if job.command else "#",
        "# submit with: sbatch " + comment(_q(f"{job.run_dir}/{SCRIPT}")),
        "# what each part does: docs/multinode.md#slurm",
        "#",
        *("# " + comment(line) if line else "#" for line in job.plan),
        "#",
        *sbatch_lines(job),
        "",
    ]
    overrides = "\n".join(f"  {_q(o)}" for o in job.overrides)
    body = f"""set -u
cd {_q(job.workdir)}
# sbatch passes the submitting shell's environment on (--export=ALL): LORAKIT_PYTHON set there chooses
# another interpreter; a PYTHON variable of the user's is not read.
PYTHON=${{LORAKIT_PYTHON:-{_q(job.python)}}}
RECIPE={_q(job.recipe)}
RUN_DIR={_q(job.run_dir)}
OVERRIDES=(
{overrides}
)
# Every attempt (the first, and each requeue: SLURM_RESTART_COUNT) logs into its own folder.
attempt=${{SLURM_RESTART_COUNT:-0}}
LOGS="$RUN_DIR/logs/attempt-$attempt"
mkdir -p "$LOGS"
if [ "$attempt" -gt 0 ]; then
  # A requeued attempt continues from this run's newest checkpoint, whatever train.resume said for the first.
  OVERRIDES+=(train.resume=auto)
fi

# The rendezvous: the allocation's first node, on a port derived from the job id (jobs sharing a node do
# not collide), below Linux's ephemeral ports (32768-60999), which outgoing connections take; export
# MASTER_PORT before sbatch to choose it.
HOSTS=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD=$(echo "$HOSTS" | head -n 1)
PORT=${{MASTER_PORT:-$(({PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN}))}}
echo "lorakit: job $SLURM_JOB_ID attempt $attempt on {n} node(s), rendezvous $HEAD:$PORT, logs $LOGS"
# A stop request before training starts (the notice came early): no training now, back to the queue.
stopped=0
trap 'stopped=1' USR1 TERM

# 1. The preflight, one process per node: every node reaches $HEAD:$PORT, its network (NCCL_*, InfiniBand,
# interface) is reported, an all_reduce across the nodes runs; each step is bounded, and a failure stops the
# job here, before any weights load, naming the node and the cause (lines prefixed by the node's number).
srun --ntasks-per-node=1 --kill-on-bad-exit=1 --label \\
  "$PYTHON" -m lorakit.doctor "$RECIPE" "${{OVERRIDES[@]}}" --nodes {n} --rendezvous "$HEAD:$PORT" \\
  --hosts "$(echo "$HOSTS" | paste -sd, -)" --timeout {job.preflight_timeout} --output "$LOGS/preflight"
code=$?
if [ $code -ne 0 ]; then
  echo "lorakit: the preflight failed (exit code $code; the lines above name the node and the cause): nothing was trained" >&2
  exit {PREFLIGHT_FAILED}
fi
if [ $stopped -eq 1 ]; then
  echo "lorakit: stop requested before training started: requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
  exit {PREEMPTED}
fi

# 2. Training: one launcher per node (lorakit.slurm.node: torchrun with this node's rank, rendezvous at
# $HEAD:$PORT), its output in $LOGS/node-<host>.log and each rank's in $LOGS/node-<host>/.
# A stop request (the time limit's notice, SIGUSR1; preemption or scancel, SIGTERM) is passed to srun as
# SIGUSR1, which srun hands to every process of the step: the ranks finish their step, save a checkpoint
# and exit 75. (srun turns a SIGTERM of its own into SIGKILL for the step, so it is never sent one.)
rm -f "$RUN_DIR/exit.json"  # a previous attempt's verdict must not be read as this one's
stop() {{
  echo "lorakit: stop requested: asking every rank to checkpoint and exit"
  kill -USR1 "$TRAIN" 2>/dev/null
}}
trap stop USR1 TERM
# Passed explicitly: srun of some Slurm versions (from 22.05) does not give its step the job's --cpus-per-task.
# --kill-on-bad-exit: a node whose launcher dies ends the step on every node at once, rather than leaving the
# others waiting in a collective until distributed.timeout_minutes.
srun --ntasks-per-node=1 --kill-on-bad-exit=1 ${{SLURM_CPUS_PER_TASK:+--cpus-per-task=$SLURM_CPUS_PER_TASK}} --output="$LOGS/node-%N.log" \\
  "$PYTHON" -m lorakit.slurm.node --nodes {n} --gpus-per-node {g} --rendezvous "$HEAD:$PORT" \\
  --logs "$LOGS" --stop-timeout {max(job.stop_before - 30, 30)} -- "$RECIPE" "${{OVERRIDES[@]}}" &
TRAIN=$!
# wait returns early when a trapped signal arrives; wait again until srun has ended.
while kill -0 "$TRAIN" 2>/dev/null; do wait "$TRAIN"; done
wait "$TRAIN"
code=$?

# The job ends with lorakit's exit code (docs/resume.md#exit-codes): what rank 0 recorded in exit.json
# (75 preempted, 4 diverged, 74 disk full, 1 a rank failed), else srun's.
if [ $code -ne 0 ] && [ -f "$RUN_DIR/exit.json" ]; then
  recorded=$("$PYTHON" -c 'import json, sys; print(int(json.load(open(sys.argv[1]))["code"]))' "$RUN_DIR/exit.json") \\
    && code=$recorded
fi
if [ "$code" -eq {PREEMPTED} ]; then
  # Preempted with a checkpoint: back to the queue; the requeued job resumes in $RUN_DIR.
  echo "lorakit: preempted, checkpoint saved: requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
fi
echo "lorakit: exit code $code"
exit "$code"
"""
    return "\n".join(head) + "\n" + body
