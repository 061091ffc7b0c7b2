"""What a node's network looks like to NCCL and gloo, for the multi-node preflight (doctor/nodes.py): the
interface the kernel routes to the rendezvous host, InfiniBand devices and their ports, the NCCL_* and
GLOO_* variables, and settings that name an interface or device this node does not have (the usual cause of
a multi-node job that hangs at its first barrier).

`environ` is passed in (the command line's os.environ): this module reads no variables itself.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from pathlib import Path

IB_ROOT = Path("/sys/class/infiniband")
# Variables reported besides NCCL_*: the gloo backend's interface choice and UCX's devices (used by NCCL's
# UCX plugin and by MPI).
OTHER_VARS = ("GLOO_SOCKET_IFNAME", "UCX_NET_DEVICES", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def interfaces() -> dict[str, dict]:
    """Network interfaces of this node: name -> {"up": bool, "addresses": [IPv4/IPv6 addresses]}."""
    import psutil

    stats = psutil.net_if_stats()
    out = {}
    for name, addrs in psutil.net_if_addrs().items():
        ips = [a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
        out[name] = {"up": bool(stats[name].isup) if name in stats else False, "addresses": ips}
    return out


def route_to(host: str, port: int, ifaces: Mapping[str, dict]) -> dict:
    """The local address and interface the kernel picks to reach `host` (a UDP socket's connect sends
    nothing); {"error": ...} when the name does not resolve or there is no route."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        family, _, _, _, address = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(address)
            local = s.getsockname()[0]
    except OSError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    name = next((n for n, i in ifaces.items() if local in i["addresses"]), None)
    return {"host_address": address[0], "local_address": local, "interface": name}


def infiniband(root: Path = IB_ROOT) -> list[dict]:
    """InfiniBand / RoCE devices under /sys/class/infiniband with each port's state, rate and link layer."""
    if not root.is_dir():
        return []
    devices = []
    for dev in sorted(root.iterdir()):
        ports = []
        for port in sorted((dev / "ports").glob("*")):
            ports.append({"port": port.name, **{k: _read(port / k) for k in ("state", "rate", "link_layer")}})
        devices.append({"name": dev.name, "ports": ports})
    return devices


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def variables(environ: Mapping[str, str]) -> dict[str, str]:
    """NCCL_* and the other transport variables that are set."""
    return {k: v for k, v in sorted(environ.items()) if k.startswith("NCCL_") or k in OTHER_VARS}


def node_report(head: str, port: int, environ: Mapping[str, str]) -> dict:
    """Everything above for this node, as JSON-able data."""
    ifaces = interfaces()
    return {
        "host": socket.gethostname(),
        "interfaces": ifaces,
        "route": route_to(head, port, ifaces),
        "infiniband": infiniband(),
        "variables": variables(environ),
    }


def _nccl_list(value: str) -> tuple[bool, bool, list[str]]:
    """NCCL's list syntax (NCCL_SOCKET_IFNAME, NCCL_IB_HCA): '^' excludes, '=' matches names exactly
    (otherwise prefixes); returns (exclude, exact, names without ':port')."""
    exclude = value.startswith("^")
    value = value.lstrip("^")
    exact = value.startswith("=")
    names = [n.split(":")[0] for n in value.lstrip("=").split(",") if n]
    return exclude, exact, names


def _matches(candidates: list[str], value: str) -> list[str]:
    exclude, exact, names = _nccl_list(value)

    def hit(c: str) -> bool:
        return any(c == n if exact else c.startswith(n) for n in names)

    return [c for c in candidates if hit(c) != exclude]


def problems(report: Mapping) -> list[str]:
    """Settings that cannot work on this node: an interface or device named by NCCL_SOCKET_IFNAME,
    GLOO_SOCKET_IFNAME or NCCL_IB_HCA that it does not have (or that is down), and a rendezvous host it
    cannot route to. Empty when none."""
    out = []
    env = report["variables"]
    up = [n for n, i in report["interfaces"].items() if i["up"]]
    if "error" in report["route"]:
        out.append(f"no route to the rendezvous host: {report['route']['error']}")
    if env.get("NCCL_SOCKET_IFNAME") and not _matches(up, env["NCCL_SOCKET_IFNAME"]):
        out.append(
            f"NCCL_SOCKET_IFNAME={env['NCCL_SOCKET_IFNAME']} matches no interface that is up here (up: "
            f"{', '.join(up) or 'none'}): NCCL would find no socket interface"
        )
    for name in filter(None, env.get("GLOO_SOCKET_IFNAME", "").split(",")):
        if name not in up:
            out.append(
                f"GLOO_SOCKET_IFNAME names {name}, which is not an interface that is up here (up: "
                f"{', '.join(up) or 'none'})"
            )
    hcas = [d["name"] for d in report["infiniband"]]
    if (
        env.get("NCCL_IB_HCA")
        and env.get("NCCL_IB_DISABLE", "0") != "1"
        and not _matches(hcas, env["NCCL_IB_HCA"])
    ):
        out.append(
            f"NCCL_IB_HCA={env['NCCL_IB_HCA']} matches no InfiniBand device here "
            f"({', '.join(hcas) or 'none under ' + str(IB_ROOT)})"
        )
    return out


def describe(report: Mapping) -> str:
    """One line: host, route to the head, InfiniBand ports, and the variables set."""
    route = report["route"]
    if "error" in route:
        via = f"no route to the rendezvous host ({route['error']})"
    else:
        via = f"reaches the rendezvous via {route['interface'] or '?'} ({route['local_address']})"
    ports = [
        f"{d['name']}:{p['port']} {(p['state'] or '?').split(':')[-1].strip()} {p['rate'] or ''}".strip()
        for d in report["infiniband"]
        for p in d["ports"]
    ]
    ib = "InfiniBand: " + (", ".join(ports) if ports else "none")
    env = report["variables"]
    if env.get("NCCL_IB_DISABLE") == "1" and ports:
        ib += " (NCCL_IB_DISABLE=1: NCCL uses TCP sockets instead)"
    nccl = (
        ", ".join(f"{k}={v}" for k, v in env.items())
        or "no NCCL_* set (NCCL chooses interface and transport)"
    )
    return f"{report['host']}: {via}; {ib}; {nccl}"
