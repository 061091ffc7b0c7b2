"""Several nodes, simulated on 127.0.0.1: two launchers of one process each give the same run (per-step
losses and saved adapter) as one launcher of two processes, with torchrun's c10d rendezvous and with the
deepspeed launcher's hostfile. See docs/multinode.md.

The one-node reference runs as users start it, `python -m lorakit.run` (which starts torchrun with 2
processes), with HOME, TMPDIR and the working directory pointed at fresh directories: it also shows that
a run writes nothing outside output.dir and data.cache_dir. Its data holds two bad rows under
data.on_bad_rows skip, so it also shows skips reaching summary.json from a 2-process ZeRO-3 run.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from lorakit import rundir
from lorakit.data.samples import builtin_dataset_dir
from lorakit.engine.checkpoint import complete_checkpoints
from lorakit.engine.launch import free_port
from lorakit.runlock import LOCK
from tests.conftest import RECIPES, ROOT, run_cli
from tests.process_groups import finish_group, kill_group, start_group

pytestmark = pytest.mark.slow

BAD_ROWS = ['{"article": "a storm", "highlights": ', '{"article": "a storm", "highlights": null}']
# Generous: on a 2-core machine these runs share the CPU with whatever else the suite runs meanwhile.
TIMEOUT = 600


def _env(**extra) -> dict[str, str]:
    # One thread per process, as torchrun sets it (the deepspeed launcher does not): 2 processes share 2
    # cores here, and the runs compared must not differ in threading.
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


def _overrides(source: Path, cache: Path, out: Path) -> list[str]:
    return [
        "model.dtype=float32",
        "model.gradient_checkpointing=false",
        f"data.source={source}",
        "data.on_bad_rows=skip",
        "data.eval_split=null",
        "data.max_samples=32",
        "data.max_length=128",
        "train.max_steps=3",
        "train.max_tokens=512",
        "train.seed=7",
        "eval.enabled=false",
        f"data.cache_dir={cache}",
        f"output.dir={out}",
    ]


def _run_together(
    commands: list[list[str]], env: dict[str, str], cwd: Path = ROOT
) -> list[subprocess.CompletedProcess]:
    """Start every command at once (the nodes of one job) and wait for all of them. Each launcher gets
    its own process group, so a run that hangs is stopped with the workers it started."""
    procs = [start_group(c, env, cwd, merge_stderr=True) for c in commands]
    try:
        return [finish_group(p, TIMEOUT) for p in procs]
    finally:
        for p in procs:
            kill_group(p)


def _train_records(run_dir: Path) -> list[dict]:
    return [r for r in rundir.read_metrics(run_dir) if r["kind"] == "train"]


def _assert_same_run(run_dir: Path, reference: Path) -> None:
    ours, theirs = _train_records(run_dir), _train_records(reference)
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == [1, 2, 3]
    for a, b in zip(ours, theirs, strict=True):
        for key in ("loss", "grad_norm", "target_tokens"):
            assert abs(a[key] - b[key]) <= 1e-6, (key, a, b)
    adapter, expected = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (run_dir, reference))
    assert adapter.keys() == expected.keys() and adapter
    worst = max(float((adapter[k] - expected[k]).abs().max()) for k in adapter)
    assert worst <= 1e-6, worst
    assert rundir.read_summary(run_dir)["world_size"] == 2


@pytest.fixture(scope="module")
def job(tmp_path_factory, cache_dir):
    """The data file (builtin news rows with two bad lines) and the one-node reference run."""
    base = tmp_path_factory.mktemp("multinode")
    lines = (builtin_dataset_dir("news_summaries") / "train.jsonl").read_text().splitlines()[:32]
    lines[4:4] = BAD_ROWS[:1]
    lines[10:10] = BAD_ROWS[1:]
    source = base / "news.jsonl"
    source.write_text("\n".join(lines) + "\n")
    home, tmp, cwd = (base / d for d in ("home", "tmp", "cwd"))
    for d in (home, tmp, cwd):
        d.mkdir()
    reference = base / "one-node"
    env = _env(
        HOME=str(home),
        TMPDIR=str(tmp),
        # DeepSpeed's compiled CPU communication kernel: a per-machine cache of every torch program, kept
        # where it is (pointing it into data.cache_dir would recompile it for every cache).
        TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR")
        or str(Path("~/.cache/torch_extensions").expanduser()),
        # matplotlib's font list (built once when loss.png is first drawn): a per-user cache too.
        MPLCONFIGDIR=os.environ.get("MPLCONFIGDIR") or str(Path("~/.cache/matplotlib").expanduser()),
    )
    for var in ("HF_HOME", "HF_DATASETS_CACHE", "XDG_CACHE_HOME", "TRITON_CACHE_DIR"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "lorakit.run", str(RECIPES / "quickstart_causal.yaml")]
    (proc,) = _run_together([cmd + _overrides(source, cache_dir, reference)], env, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return {"source": source, "reference": reference, "proc": proc, "roots": (home, tmp, cwd)}


def test_one_node_run_writes_only_into_its_directories_and_counts_bad_rows(job):
    # Empty directories are allowed: torchrun makes its log directories under TMPDIR (torchelastic_*) and
    # torch an inductor cache directory there, and leave them empty. Hub downloads would go to the
    # Hugging Face cache (HF_HOME) as usual; this run has none.
    for root in job["roots"]:
        assert [str(p) for p in root.rglob("*") if not p.is_dir()] == [], root
    summary = rundir.read_summary(job["reference"])
    assert summary["world_size"] == 2 and summary["zero_stage"] == 3
    bad = summary["data"]["bad_rows"]
    assert bad["policy"] == "skip" and bad["skipped"] == 2
    assert [line.split(": ", 1)[0] for line in bad["first"]] == [f"{job['source']} line {n}" for n in (5, 11)]
    assert "bad rows left out (data.on_bad_rows skip): train 2" in job["proc"].stdout
    # The weights lorakit writes are safetensors. DeepSpeed's resumable checkpoints (checkpoints/) are its
    # own torch.save files, read back only by lorakit's resume from the run's own directory.
    assert (job["reference"] / "adapter" / "adapter_model.safetensors").is_file()
    pickles = {".bin", ".pt", ".pkl", ".pth"}
    found = [p for p in job["reference"].rglob("*") if p.suffix in pickles and "checkpoints" not in p.parts]
    assert found == []


def test_two_torchrun_nodes_match_one_node_without_a_shared_data_cache(job, cache_dir, tmp_path):
    """Two torchrun launchers, --nnodes 2 --nproc_per_node 1, meeting at a c10d rendezvous on 127.0.0.1.
    Each "node" has its own data.cache_dir (the tiny model copied in; the tokenized data not), so the
    second node prepares the data for itself."""
    own_cache = tmp_path / "node1-cache"
    shutil.copytree(cache_dir / "models", own_cache / "models")
    out = tmp_path / "two-nodes"
    endpoint = f"127.0.0.1:{free_port()}"
    # The launchers on the session's warm interpreter (PYTHON_EXEC, tests/conftest.py), as their ranks are.
    python = os.environ.get("PYTHON_EXEC", sys.executable)
    commands = [
        [
            python,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc_per_node=1",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={endpoint}",
            "--rdzv_id=lorakit-test",
            "-m",
            "lorakit.run",
            str(RECIPES / "quickstart_causal.yaml"),
            *_overrides(job["source"], cache, out),
        ]
        for cache in (cache_dir, own_cache)
    ]
    for proc in _run_together(commands, _env()):
        assert proc.returncode == 0, proc.stdout[-4000:]
    _assert_same_run(out, job["reference"])
    # No lorakit launcher above the ranks: rank 0 held the run lock, and gave it back at the end.
    assert not (out / LOCK).exists()
    key = Path(rundir.read_summary(job["reference"])["data"]["cache_dir"]).name
    assert (own_cache / "datasets" / key / "meta.json").is_file()


def test_deepspeed_launcher_hostfile_nodes_match_one_node(job, cache_dir, tmp_path):
    """The deepspeed launcher with a hostfile of two hosts, one slot each, started once per node with
    --no_ssh --node_rank (its default mode, where node 0 starts the others through pdsh, needs ssh between
    machines). Both nodes share the data cache here. lorakit.run takes the --local_rank argument this
    launcher passes to its processes."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    out = tmp_path / "deepspeed"
    port = free_port()
    commands = [
        [
            sys.executable,
            "-m",
            "deepspeed.launcher.runner",
            f"--hostfile={hostfile}",
            "--no_ssh",
            f"--node_rank={rank}",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            "--module",
            "lorakit.run",
            str(RECIPES / "quickstart_causal.yaml"),
            *_overrides(job["source"], cache_dir, out),
        ]
        for rank in (0, 1)
    ]
    procs = _run_together(commands, _env(DS_ACCELERATOR="cpu"))
    for proc in procs:
        assert proc.returncode == 0, proc.stdout[-4000:]
    assert "'--local_rank=0'" in procs[1].stdout  # the launcher's own log of the command it started
    _assert_same_run(out, job["reference"])
    assert not (out / LOCK).exists()


# Slurm on one machine: stand-ins for srun and scontrol (tests/integration/slurm_standins), first on PATH,
# and the variables sbatch gives a job. The two "nodes" are two names for this machine.
STANDINS = Path(__file__).with_name("slurm_standins")
FAULTS = Path(__file__).with_name("faults")
NODES = "127.0.0.1,127.0.0.2"
JOB_ID = "4242"


@pytest.fixture
def slurm_bin(tmp_path) -> Path:
    """A folder with `srun` and `scontrol` running the stand-ins (python -I: nothing but the standard library)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("srun", "scontrol"):
        shim = bin_dir / tool
        shim.write_text(f'#!/bin/sh\nexec {sys.executable} -I {STANDINS / tool}.py "$@"\n')
        shim.chmod(0o755)
    return bin_dir


def _slurm_env(bin_dir: Path, record: Path, port: int, **extra) -> dict[str, str]:
    return _env(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        SLURM_JOB_ID=JOB_ID,
        SLURM_JOB_NODELIST=NODES,
        SLURM_JOB_NUM_NODES="2",
        SLURM_NNODES="2",
        SLURM_STANDIN_RECORD=str(record),
        MASTER_PORT=str(port),
        **extra,
    )


def _write_job(recipe_args: list[str]) -> Path:
    """python -m lorakit.slurm for 2 nodes x 1 GPU, as docs/multinode.md shows it (forked from the session's
    warm interpreter: its environment is the server's); the script's path, which the command prints last."""
    args = [str(RECIPES / "quickstart_causal.yaml"), *recipe_args, "--nodes", "2", "--gpus-per-node", "1"]
    out = Path([a for a in recipe_args if a.startswith("output.dir=")][-1].split("=", 1)[1])
    done = run_cli("lorakit.slurm", *args, "--time", "00:30:00", env=_env())
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == str(out / "job.sbatch"), done.stderr
    return out / "job.sbatch"


def _wait_for(predicate, proc: subprocess.Popen, what: str, limit: float = TIMEOUT) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            out = finish_group(proc, 5).stdout
            raise AssertionError(f"the job ended (or {limit} s passed) before {what}:\n{out[-6000:]}")
        time.sleep(0.2)


def test_slurm_job_preflights_is_requeued_on_sigterm_and_resumes_like_one_run(
    job, cache_dir, tmp_path, slurm_bin
):
    """The generated job.sbatch run as Slurm would, on two "nodes" of one process: the preflight passes, a
    SIGTERM to the job while it trains leads to a checkpoint, exit 75 and `scontrol requeue`; the requeued
    job (same id, SLURM_RESTART_COUNT=1) resumes in the same run directory and ends as the one-node run of
    the same recipe does (losses and adapter to 1e-6)."""
    out = tmp_path / "slurm-run"
    script = _write_job(_overrides(job["source"], cache_dir, out))
    # The command writes the script and nothing else; the plan for 2 x 1 heads it.
    assert sorted(p.name for p in out.iterdir()) == [".lorakit-run", "job.sbatch"]  # marker, script
    text = script.read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --signal=B:USR1@300",
                 "#SBATCH --requeue", "#SBATCH --time=00:30:00", "# hardware: 2 node(s) x 1 GPU(s)"):  # fmt: skip
        assert line in text, line
    record, hold, port = tmp_path / "slurm-record", tmp_path / "go", free_port()
    # Rank 0 waits before its first step until `go` exists (faults/sitecustomize.py): the SIGTERM is sent
    # while the job is known to be training.
    env = _slurm_env(
        slurm_bin, record, port, PYTHONPATH=f"{FAULTS}{os.pathsep}{ROOT}", LORAKIT_HOLD_UNTIL=str(hold)
    )
    logs = out / "logs" / "attempt-0"
    proc = start_group(["bash", str(script)], env, ROOT, merge_stderr=True)
    try:
        _wait_for(Path(f"{hold}.waiting").exists, proc, "rank 0 started training")
        os.kill(proc.pid, signal.SIGTERM)  # Slurm's SIGTERM (preemption, scancel) to the batch script
        asked = "asking the ranks to checkpoint and stop"
        node_logs = [logs / f"node-{n}.log" for n in NODES.split(",")]
        _wait_for(lambda: all(asked in p.read_text() for p in node_logs), proc, "both launchers passed it on")
        hold.touch()
        first = finish_group(proc, TIMEOUT)
    finally:
        kill_group(proc)
    assert first.returncode == 75, first.stdout[-6000:]
    assert record.read_text() == f"requeue {JOB_ID}\n"
    ckpt = complete_checkpoints(out)[-1]
    assert ckpt.state["reason"] == "preempted" and 1 <= ckpt.step < 3
    # The preflight ran first, on both nodes, with the all_reduce across them.
    assert "1: preflight: node 1 (127.0.0.2): every check passed" in first.stdout
    report = rundir.read_json_if_exists(logs / "preflight" / "doctor.json")
    assert report["ok"], report
    (reduce,) = [c for c in report["checks"] if c["name"] == "all_reduce across nodes"]
    assert reduce["status"] == "pass" and reduce["data"]["world"] == 2
    # Logs per node (srun --output) and per rank (torchrun's tee); each node's launcher ran torchrun with
    # its node rank and the job's rendezvous.
    for n, log in enumerate(node_logs):
        assert f"--node-rank={n} --master-addr=127.0.0.1 --master-port={port}" in log.read_text()
    assert len(list(logs.glob("node-*/job-4242_*/attempt_0/0/stdout.log"))) == 2

    # Slurm starts the requeued job: the same script, the same job id, SLURM_RESTART_COUNT=1.
    env = _slurm_env(slurm_bin, record, free_port(), SLURM_RESTART_COUNT="1")
    (second,) = _run_together([["bash", str(script)]], env)
    assert second.returncode == 0, second.stdout[-6000:]
    assert "lorakit: exit code 0" in second.stdout and record.read_text() == f"requeue {JOB_ID}\n"
    assert rundir.read_summary(out)["resumed_from"]["step"] == ckpt.step
    assert (out / "logs" / "attempt-1" / "preflight" / "doctor.json").is_file()
    _assert_same_run(out, job["reference"])
    assert not (out / LOCK).exists()


def test_slurm_preflight_stops_the_job_in_seconds_naming_the_node_when_the_port_is_closed(
    cache_dir, tmp_path, slurm_bin
):
    """The rendezvous port is closed: another socket holds it without listening, so node 0 cannot open it
    and connections to it are refused. The job stops at the preflight (exit code 3) within a minute, naming
    the node and the cause, before anything is trained."""
    out = tmp_path / "closed"
    script = _write_job([f"data.cache_dir={cache_dir}", f"output.dir={out}"])
    with socket.socket() as blocker:
        blocker.bind(("0.0.0.0", 0))
        port = blocker.getsockname()[1]
        start = time.monotonic()
        (done,) = _run_together([["bash", str(script)]], _slurm_env(slurm_bin, tmp_path / "record", port))
        took = time.monotonic() - start
    assert done.returncode == 3, done.stdout[-6000:]
    assert took < 60, took
    assert f"node 0 (127.0.0.1) could not open the rendezvous port {port}" in done.stdout
    assert "address already in use" in done.stdout and "set MASTER_PORT" in done.stdout
    assert "the preflight failed" in done.stdout and "nothing was trained" in done.stdout
    # Nothing of a run: no training step was started, no weights loaded.
    assert sorted(p.name for p in out.iterdir()) == [".lorakit-run", "job.sbatch", "logs"]
    assert not (tmp_path / "record").exists()
