"""The multi-node preflight: `python -m lorakit.doctor RECIPE [K=V ...] --nodes N --rendezvous HOST:PORT`, one
process per node (the Slurm job of lorakit.slurm starts it with srun on every node before training).

In order, each step bounded by `timeout` seconds, before any model or data is touched:
1. rendezvous: node 0 opens a TCP store at HOST:PORT (the port training will use), every other node
   connects to it, and each node checks in; a node that cannot open or reach it, or a node that never
   checks in, fails naming the node and the cause (connection refused, no answer, a name that does not
   resolve, a port in use);
2. network: each node's route to HOST, InfiniBand devices and the NCCL_* / GLOO_* variables, reported for
   every node by node 0; a variable naming an interface or device the node lacks fails on that node;
   GPUs: a node with fewer GPUs than the job starts processes per node fails;
3. all_reduce: one process per node, across the nodes (the network between them), with its bus bandwidth.

Every node learns through the store whether all others passed before the all_reduce, so one failing node
ends every node's preflight at once; a watchdog ends a node that is still stuck after all the bounds.
Node 0 prints the table and writes doctor.json and doctor.md; every node exits 0 only when all passed.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from lorakit.doctor import network
from lorakit.doctor.result import CheckResult, DoctorReport, failed, passed, skipped

SECTION = "environment"
RENDEZVOUS_TIMEOUT = 30.0
FIREWALL = (
    "check that nothing blocks the port between the nodes (firewall, security group), or set MASTER_PORT"
)


class NodeFailure(Exception):
    """A step of this node's preflight failed: the CheckResult says which, why and what to do."""

    def __init__(self, check: CheckResult):
        super().__init__(check.detail)
        self.check = check


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """'host:port' -> (host, port); ValueError naming the expected form."""
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--rendezvous: expected HOST:PORT, got {endpoint!r}")
    return host.strip("[]"), int(port)


def reach(host: str, port: int, timeout: float, who: str) -> None:
    """Connect to host:port until it answers or `timeout` seconds pass (the head may still be starting);
    raise NodeFailure naming the cause of the last attempt."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((host, port), timeout=max(min(left, 5.0), 0.1)).close()
            return
        except socket.gaierror as e:
            cause = f"the name {host} does not resolve on this node ({e.strerror})"
            action = "use a host name every node resolves (scontrol show hostnames), or its address"
        except ConnectionRefusedError:
            cause = "connection refused: nothing listens there (node 0's preflight did not open it) or a firewall rejects it"
            action = FIREWALL
        except OSError as e:  # a timeout or an unreachable network: packets dropped
            cause = f"no answer ({e.strerror or type(e).__name__}): a firewall drops the packets or the host is unreachable"
            action = FIREWALL + "; NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME if the nodes have several networks"
        if time.monotonic() + 0.5 >= deadline:
            raise NodeFailure(
                failed(
                    SECTION,
                    "rendezvous",
                    f"{who} could not reach the rendezvous {host}:{port} within {timeout:g} s: {cause}",
                    "the job would hang at its first barrier",
                    action,
                )  # fmt: skip
            )
        time.sleep(0.5)


def open_store(host: str, port: int, *, rank: int, nodes: int, timeout: float, who: str):
    """Node 0 opens the rendezvous store on `port`; the others connect to it."""
    from torch.distributed import TCPStore

    td = datetime.timedelta(seconds=timeout)
    if rank == 0:
        try:
            return TCPStore(host, port, world_size=nodes, is_master=True, timeout=td, wait_for_workers=False)
        except RuntimeError as e:
            raise NodeFailure(
                failed(
                    SECTION,
                    "rendezvous",
                    f"{who} could not open the rendezvous port {port}: {e}",
                    "no node can join this job's rendezvous",
                    "another process holds the port on this node: set MASTER_PORT to a free port",
                )  # fmt: skip
            ) from e
    reach(host, port, timeout, who)
    return TCPStore(host, port, world_size=nodes, is_master=False, timeout=td)


def wait_for(store, keys: list[str], timeout: float) -> list[str]:
    """The keys still missing after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    missing = list(keys)
    while missing and time.monotonic() < deadline:
        missing = [k for k in missing if not store.check([k])]
        if missing:
            time.sleep(0.1)
    return missing


def store_lost(who: str, error: Exception) -> NodeFailure:
    """Node 0's store went away under this node: node 0's preflight ended (it failed, or was stopped)."""
    return NodeFailure(
        failed(
            SECTION,
            "rendezvous",
            f"{who} lost the rendezvous: node 0 left it ({error})",
            "node 0 stopped its preflight",
            "see node 0's lines in the job's log",
        )  # fmt: skip
    )


def _watchdog(seconds: float, who: str) -> threading.Timer:
    """End this process if the preflight is still running after `seconds`: a collective that never returns
    (an NCCL connection that hangs) must not hold the job."""

    def fire():
        print(
            f"preflight: {who}: FAILED: still not done after {seconds:g} s (stuck in the all_reduce across "
            "nodes: run with NCCL_DEBUG=INFO, see docs/multinode.md#when-the-first-barrier-hangs)",  # fmt: skip
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def gpu_check(processes: int, who: str) -> CheckResult:
    """Enough GPUs on this node for the processes the job starts on it."""
    import torch

    if not torch.cuda.is_available():
        return skipped(SECTION, "gpus", f"{who}: no GPU visible (a CPU run: gloo)")
    count = torch.cuda.device_count()
    if count < processes:
        return failed(SECTION, "gpus", f"{who} sees {count} GPU(s); the job starts {processes} process(es) per node",
                      "ranks would share GPUs or fail to start", "ask Slurm for --gpus-per-node matching the job, "
                      "or check CUDA_VISIBLE_DEVICES on that node")  # fmt: skip
    return passed(SECTION, "gpus", f"{who}: {count} x {torch.cuda.get_device_name(0)}")


def all_reduce(store, *, rank: int, nodes: int, backend: str, timeout: float) -> CheckResult:
    """One process per node joins a group over the rendezvous store and times an all_reduce."""
    import torch
    import torch.distributed as dist

    from lorakit.doctor.allreduce import measure
    from lorakit.doctor.core import _bandwidth

    if backend == "nccl":
        torch.cuda.set_device(0)
    group_store = dist.PrefixStore("all_reduce", store)
    td = datetime.timedelta(seconds=timeout)
    try:
        dist.init_process_group(backend, store=group_store, rank=rank, world_size=nodes, timeout=td)
        try:
            result = _bandwidth(measure())
        finally:
            dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - any failure of the collective is this check's verdict
        return failed("speed", "all_reduce across nodes", f"{backend} all_reduce across {nodes} nodes failed: "
                      f"{type(e).__name__}: {e}", "training would fail or hang at its first collective",
                      "run with NCCL_DEBUG=INFO (GPUs) and see docs/multinode.md#when-the-first-barrier-hangs")  # fmt: skip
    detail = f"across {nodes} nodes, one process each: " + result.detail
    return passed(result.section, "all_reduce across nodes", detail, **result.data)


def preflight_nodes(
    recipe,
    *,
    nodes: int,
    rank: int,
    endpoint: str,
    environ: Mapping[str, str],
    hosts: list[str] | None = None,
    timeout: float = RENDEZVOUS_TIMEOUT,
    output: str | Path | None = None,
) -> DoctorReport:
    """This node's part of the multi-node preflight (module docstring); node 0's report has every node's
    checks and is written to `output`."""
    from lorakit.engine.launch import resolve_backend

    start = time.perf_counter()
    head, port = split_endpoint(endpoint)
    name = hosts[rank] if hosts and rank < len(hosts) else socket.gethostname()
    who = f"node {rank} ({name})"
    # Rendezvous, checks, the all_reduce: three bounds, and some slack for the imports around them.
    watchdog = _watchdog(3 * timeout + 30, who)
    checks: list[CheckResult] = []
    try:
        store = open_store(head, port, rank=rank, nodes=nodes, timeout=timeout, who=who)
        local = network.node_report(head, port, environ)
        store.set(f"node/{rank}", json.dumps({**local, "name": name}))
        missing = wait_for(store, [f"node/{i}" for i in range(nodes)], timeout) if rank == 0 else []
        if missing:
            absent = ", ".join(f"node {k.split('/')[1]}" + (f" ({hosts[int(k.split('/')[1])]})" if hosts else "")
                               for k in missing)  # fmt: skip
            raise NodeFailure(failed(SECTION, "rendezvous", f"{absent} did not reach the rendezvous {head}:{port} "
                                     f"within {timeout:g} s", "the job would hang at its first barrier",
                                     f"see that node's log; {FIREWALL}"))  # fmt: skip
        checks.append(passed(SECTION, "rendezvous", f"{who} met the others at {head}:{port}" if rank else
                             f"{nodes} nodes met at {head}:{port} in {time.perf_counter() - start:.1f} s"))  # fmt: skip
        own, others = _network_checks(store, rank, nodes, local, who)
        own.append(gpu_check(recipe.distributed.num_processes, who))
        checks += own + others
        # Every node says whether it passed, so that none waits in the all_reduce for a node that left.
        mine = [c for c in own if not c.passed]
        store.set(f"ok/{rank}", "1" if not mine else who)
        late = wait_for(store, [f"ok/{i}" for i in range(nodes)], timeout)
        bad = [store.get(f"ok/{i}").decode() for i in range(nodes) if f"ok/{i}" not in late]
        bad = [b for b in bad if b != "1"] + [
            f"node {k.split('/')[1]} (did not finish its checks)" for k in late
        ]
        if bad and not mine:
            checks.append(skipped("speed", "all_reduce across nodes", f"{', '.join(bad)} failed a check"))
        elif not bad:
            backend = resolve_backend(recipe.distributed.backend)
            checks.append(all_reduce(store, rank=rank, nodes=nodes, backend=backend, timeout=timeout))
        # Node 0 holds the store: it leaves last, so no node loses the store while still reading from it.
        store.set(f"done/{rank}", "1")
        if rank == 0:
            wait_for(store, [f"done/{i}" for i in range(nodes)], timeout)
    except NodeFailure as e:
        checks.append(e.check)
    except RuntimeError as e:  # torch's DistNetworkError / DistError: the store's connection broke
        checks.append(store_lost(who, e).check)
    finally:
        watchdog.cancel()
    report = DoctorReport(recipe=f"{nodes} nodes: {who}", quick=True, checks=checks,
                          seconds=time.perf_counter() - start, versions={"node": who, "rendezvous": endpoint})  # fmt: skip
    if output is not None and rank == 0:
        report.write(output)
    return report


def _network_checks(store, rank: int, nodes: int, local: dict, who: str) -> tuple[list, list]:
    """(this node's network check, and on node 0 a line for every other node: all are reported)."""
    own = [_network_check(local, who)]
    if rank != 0:
        return own, []
    reports = [json.loads(store.get(f"node/{i}")) for i in range(1, nodes)]
    return own, [_network_check(r, f"node {i} ({r['name']})") for i, r in enumerate(reports, 1)]


def _network_check(report: dict, who: str) -> CheckResult:
    line = network.describe(report)
    trouble = network.problems(report)
    if not trouble:
        return passed(SECTION, f"network {who}", line, report=report)
    return failed(SECTION, f"network {who}", f"{line}: {'; '.join(trouble)}",
                  "NCCL or gloo would fail or hang connecting the nodes",
                  "fix or unset the variable on that node (docs/multinode.md#when-the-first-barrier-hangs)",
                  report=report)  # fmt: skip


def run_from_cli(recipe, args, environ: Mapping[str, str]) -> int:
    """`python -m lorakit.doctor RECIPE --nodes N --rendezvous HOST:PORT`: run this node's part, print node
    0's table (the other nodes print their own line or failures), exit 0 when every check passed."""
    from lorakit.errors import LorakitError

    rank = (
        args.node_rank
        if args.node_rank is not None
        else environ.get("SLURM_NODEID", environ.get("NODE_RANK"))
    )
    if recipe is None or not args.rendezvous or rank is None or args.nodes < 1:
        raise LorakitError(
            "--nodes needs a RECIPE, --rendezvous HOST:PORT, and --node-rank (or SLURM_NODEID)"
        )
    try:
        split_endpoint(args.rendezvous)
    except ValueError as e:
        raise LorakitError(str(e)) from e
    hosts = args.hosts.split(",") if args.hosts else None
    report = preflight_nodes(recipe, nodes=args.nodes, rank=int(rank), endpoint=args.rendezvous, environ=environ,
                             hosts=hosts, timeout=args.timeout or RENDEZVOUS_TIMEOUT, output=args.output)  # fmt: skip
    who = report.versions["node"]
    if int(rank) == 0:
        print(report.table(), flush=True)
    for c in report.failures:
        print(f"preflight: {who}: FAILED {c.section}/{c.name}: {c.detail}" + (f"; do: {c.action}" if c.action else ""),
              file=sys.stderr, flush=True)  # fmt: skip
    if report.ok:
        print(f"preflight: {who}: every check passed ({report.seconds:.1f} s)", flush=True)
    return 0 if report.ok else 1
