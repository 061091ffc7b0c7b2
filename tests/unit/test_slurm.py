"""python -m lorakit.slurm (the sbatch script it writes), its per-node launcher's exit code, and the parts of
the multi-node preflight that need no second process: a node's network problems and a rendezvous port
that refuses connections. The script itself runs in tests/integration/test_multinode.py."""

from __future__ import annotations

import json
import socket
import subprocess
import time

import pytest

from lorakit import rundir
from lorakit.doctor import network
from lorakit.doctor.nodes import NodeFailure, reach
from lorakit.slurm.__main__ import main
from lorakit.slurm.node import verdict
from lorakit.slurm.script import JobSpec, render
from tests.conftest import RECIPES

RECIPE = str(RECIPES / "quickstart_causal.yaml")


def _args(tmp_path, *extra: str) -> list[str]:
    return [RECIPE, f"output.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}", *extra]


def test_submit_without_sbatch_on_path_is_exit_2_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no sbatch
    code = main(_args(tmp_path, "--nodes", "2", "--gpus-per-node", "8", "--submit"))
    assert code == 2
    assert "sbatch is not on PATH" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["distributed.num_processes=4", "--nodes", "2", "--gpus-per-node", "8"],
            "contradicts --gpus-per-node 8",
        ),
        (["train.no_such_key=1", "--nodes", "2", "--gpus-per-node", "8"], "no_such_key"),
        (["--nodes", "0", "--gpus-per-node", "8"], "--nodes: expected a whole number >= 1"),
    ],
)
def test_bad_input_is_exit_2_naming_it_and_writes_nothing(tmp_path, capsys, extra, message):
    assert main(_args(tmp_path, *extra)) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_folder_that_is_not_a_run_directory_is_refused_and_a_new_one_is_marked(tmp_path, capsys):
    project = tmp_path / "run"
    (project / "model").mkdir(parents=True)  # a project's own package: the job's runs would write here
    assert main(_args(tmp_path, "--nodes", "2", "--gpus-per-node", "8")) == 2
    assert "is not a lorakit run directory" in capsys.readouterr().err
    assert sorted(p.name for p in project.iterdir()) == ["model"]
    (project / "model").rmdir()
    assert main(_args(tmp_path, "--nodes", "2", "--gpus-per-node", "8")) == 0
    # The script's folder is lorakit's: the job's run (and a second generation) may write there.
    assert rundir.check_trusted(project) == "marked"
    assert main(_args(tmp_path, "--nodes", "2", "--gpus-per-node", "8")) == 0


def test_submit_hands_the_script_to_sbatch(tmp_path, monkeypatch, capsys):
    record = tmp_path / "sbatch-args"
    sbatch = tmp_path / "bin" / "sbatch"
    sbatch.parent.mkdir()
    sbatch.write_text(f'#!/bin/sh\necho "$@" > {record}\necho "Submitted batch job 77"\n')
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{sbatch.parent}:/usr/bin:/bin")
    args = [
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--partition",
        "gpu",
        "--account",
        "proj",
        "--cpus-per-task",
        "64",
    ]
    args.append("--submit")
    assert main(_args(tmp_path, "train.lr=2e-4", *args, "--gpu-memory", "80GB")) == 0
    script = tmp_path / "run" / "job.sbatch"
    assert capsys.readouterr().out.splitlines() == [str(script), "Submitted batch job 77"]
    assert record.read_text().split() == [str(script)]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        ".lorakit-run",
        "job.sbatch",
    ]  # marker, script
    text = script.read_text()
    for line in ("#SBATCH --nodes=4", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu",
                 "#SBATCH --account=proj", "#SBATCH --cpus-per-task=64", "  distributed.num_processes=8", "  train.lr=2e-4",
                 f"  output.dir={tmp_path / 'run'}", "--nodes 4 --gpus-per-node 8",
                 "# hardware: 4 node(s) x 8 GPU(s) of 80.0 GB"):  # fmt: skip
        assert line in text, line
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_the_script_quotes_what_it_passes_and_is_valid_bash(tmp_path):
    job = JobSpec(recipe="/r/my recipe.yaml", overrides=["data.prompt_template=Say: $x 'q'", "output.dir=/o"],
                  run_dir="/o", workdir="/w d", python="/py", nodes=2, gpus_per_node=1, name="j",
                  stop_before=600)  # fmt: skip
    text = render(job)
    assert "RECIPE='/r/my recipe.yaml'" in text and "cd '/w d'" in text
    assert "#SBATCH --signal=B:USR1@600" in text and "--stop-timeout 570" in text
    assert "# #SBATCH --cpus-per-task=...  (CPUs for the node's 1 processes" in text
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    # The overrides array holds the value as given (bash parses it back).
    shown = subprocess.run(["bash", "-c", text.split("OVERRIDES=(")[0].split("set -u")[0] + "OVERRIDES=(" +
                            text.split("OVERRIDES=(")[1].split(")\n")[0] + ')\nprintf "%s\\n" "${OVERRIDES[@]}"'],
                           capture_output=True, text=True).stdout  # fmt: skip
    assert shown.splitlines() == job.overrides


def test_a_node_launcher_exits_with_lorakits_code(tmp_path):
    failures = tmp_path / "failures.json"
    assert verdict(0, tmp_path, failures) == 0
    assert verdict(1, tmp_path, failures) == 1  # nothing recorded: torchrun's code
    (tmp_path / "exit.json").write_text(json.dumps({"code": 75, "error": "Preempted", "message": "stopped"}))
    assert verdict(1, tmp_path, failures) == 75


def _report(interfaces: dict, variables: dict, ib=()) -> dict:
    return {"host": "n1", "interfaces": interfaces, "route": {"interface": "eth0", "local_address": "10.0.0.2"},
            "infiniband": list(ib), "variables": variables}  # fmt: skip


IFACES = {"lo": {"up": True, "addresses": ["127.0.0.1"]}, "eth0": {"up": True, "addresses": ["10.0.0.2"]},
          "ib0": {"up": False, "addresses": []}}  # fmt: skip


@pytest.mark.parametrize(
    ("variables", "expect"),
    [
        ({}, None),
        ({"NCCL_SOCKET_IFNAME": "eth"}, None),  # a prefix
        ({"NCCL_SOCKET_IFNAME": "^lo,docker"}, None),  # everything but: eth0 is left
        ({"NCCL_SOCKET_IFNAME": "=eth"}, "NCCL_SOCKET_IFNAME==eth matches no interface that is up"),
        (
            {"NCCL_SOCKET_IFNAME": "ib"},
            "NCCL_SOCKET_IFNAME=ib matches no interface that is up here (up: lo, eth0)",
        ),
        ({"GLOO_SOCKET_IFNAME": "eth1"}, "GLOO_SOCKET_IFNAME names eth1"),
        ({"NCCL_IB_HCA": "mlx5_0"}, "NCCL_IB_HCA=mlx5_0 matches no InfiniBand device here"),
        ({"NCCL_IB_HCA": "mlx5_0", "NCCL_IB_DISABLE": "1"}, None),
    ],
)
def test_network_settings_a_node_cannot_use_are_named(variables, expect):
    found = network.problems(_report(IFACES, variables))
    assert (found == []) if expect is None else (len(found) == 1 and expect in found[0]), found


def test_infiniband_ports_and_nccl_variables_are_described(tmp_path):
    port = tmp_path / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
    (port / "link_layer").write_text("InfiniBand\n")
    ib = network.infiniband(tmp_path)
    report = _report(IFACES, {"NCCL_IB_HCA": "mlx5", "NCCL_IB_DISABLE": "1"}, ib)
    assert network.problems(report) == []
    line = network.describe(report)
    assert "InfiniBand: mlx5_0:1 ACTIVE 200 Gb/sec (4X HDR)" in line
    assert "NCCL_IB_DISABLE=1: NCCL uses TCP sockets instead" in line
    assert "reaches the rendezvous via eth0 (10.0.0.2)" in line


def test_a_closed_rendezvous_port_fails_in_its_timeout_naming_the_node_and_the_cause():
    with socket.socket() as s:  # bound, never listening: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(NodeFailure) as e:
            reach("127.0.0.1", port, 1.0, "node 3 (gpu-d)")
    assert time.monotonic() - start < 3
    assert e.value.check.detail.startswith(
        f"node 3 (gpu-d) could not reach the rendezvous 127.0.0.1:{port} within 1 s"
    )
    assert "connection refused" in e.value.check.detail and "firewall" in e.value.check.action
