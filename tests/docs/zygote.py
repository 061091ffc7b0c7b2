"""The suite's one fork server, for the doc-test blocks, the benchmarks' smoke runs
(benchmarks/harness/runner.py) and the tests that launch lorakit (tests/conftest.py's warm_interpreters):
one interpreter imports torch, transformers, lorakit and the rest once, then forks a child per `python ...`
command, so the ~8-12 s of imports is paid once per session instead of by each command and each rank.

The blocks reach it through `python` (and `python3`) shims first on their PATH, and torchrun's ranks through
PYTHON_EXEC (the shim): a tiny stdlib-only client
(this file, run with `python -S -E`) sends its arguments, working directory and environment to the server
and hands over its stdin, stdout and stderr (SCM_RIGHTS), so the child reads and writes what a fresh
`python` would; the client exits with the child's status (or dies of its signal). Each child is a process
in a session of its own, killed when its client dies (a block's timeout) and sent the SIGINT/SIGTERM/SIGHUP/
SIGUSR1 the client gets. A fresh interpreter runs what the server cannot serve exactly: options other than
-u, -m, -c, - or a script, an environment other than the server's (libraries read theirs at import; what a
launcher sets per process, RUNTIME_VARS, excepted, and see per_command), and any command when no server is
up. Either way `python` is the interpreter running the tests. A command that puts directories before the
server's PYTHONPATH gets them on sys.path, and the sitecustomize among them (the tests' fault injection) runs
in the child before the command, as site would run it.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SERVE = "import sys; from tests.docs.zygote import serve; serve(*sys.argv[1:])"
ENV_VAR = "LORAKIT_DOC_ZYGOTE"  # the server's socket path; the shims read it
# What bash itself sets or changes in the environment of the commands it runs.
SHELL_VARS = frozenset({"PWD", "OLDPWD", "SHLVL", "_"})
# What a launcher sets for each process it starts (torchrun's ranks; pytest's current test), read at run time,
# not at import: a command whose environment differs from the server's only in these is still served, with
# them set in the child as the client had them.
RUNTIME_VARS = frozenset(
    {
        "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
        "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE",
        "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "PYTEST_CURRENT_TEST", "LORAKIT_RUN_LOCK",
    }
)  # fmt: skip
# What libraries set in a test process's own environment while it works (an in-process lorakit.train, a compile),
# each read only when used, never at import, by code the server has not run: a command from that process is
# still served, with them set in the child as the client had them. Without this, one in-process test sent every
# later launch of its xdist worker to fresh interpreters (seen for MLFLOW_ALLOW_FILE_STORE, lorakit's MLflow
# sink; mlflow's telemetry session; COLUMNS/LINES; inductor's compiled-module pointer; torch's NVML switch).
SET_WHILE_WORKING = frozenset(
    {
        "MLFLOW_ALLOW_FILE_STORE", "_MLFLOW_TELEMETRY_SESSION_ID", "COLUMNS", "LINES",
        "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "PYTORCH_NVML_BASED_CUDA_CHECK",
        # llama.cpp's CPU library sets it as the GGUF tests load it; only an Intel/LLVM OpenMP runtime reads
        # it (torch's libgomp does not), and the library sets it again wherever it is loaded.
        "KMP_BLOCKTIME",
    }
)  # fmt: skip
# What a test sets for a command and a preloaded library reads at each use, never at import: MLflow's tracking
# URI (mlflow.environment_variables reads os.environ on every get()).
READ_WHEN_USED = frozenset({"MLFLOW_TRACKING_URI"})
PER_COMMAND = SHELL_VARS | RUNTIME_VARS | SET_WHILE_WORKING | READ_WHEN_USED
# The switches of the tests' startup hook (tests/integration/faults/sitecustomize.py, on a PYTHONPATH entry the
# command puts before the server's): read by that hook only, which a served child runs as a fresh interpreter's
# site module would. LORAKIT_BNB_AVX512BF16 is not one: it must act before bitsandbytes registers its kernels,
# and the server has imported bitsandbytes (through peft).
STARTUP_SWITCHES = frozenset(
    {"LORAKIT_FAULT", "LORAKIT_HOLD_UNTIL", "LORAKIT_RAISE", "LORAKIT_RAISE_AS", "LORAKIT_FAULT_STAMP"}
)
# Variables of a library that reads them only once imported: per command while the server has not imported it.
LAZY_LIBRARIES = {"WANDB_": "wandb"}
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
# Imported once by the server: what the lorakit commands and the pages' python blocks load at start.
WARM = (
    "torch",
    "numpy",
    "pyarrow",
    "datasets",
    "transformers",
    "peft",
    "accelerate",
    "deepspeed",
    "safetensors.torch",
    "matplotlib.pyplot",
    "torch.utils.tensorboard",
    "transformers.models.t5.modeling_t5",
    "transformers.models.llama.modeling_llama",
    # What every rank imports lazily while its model is built and its ZeRO engine set up (0.2 s per rank).
    "peft.utils.transformers_weight_conversion",
    "torch.utils.cpp_extension",
    "deepspeed.module_inject.auto_ep_config",
    "deepspeed.module_inject.auto_ep_layer",
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "deepspeed.ops.op_builder.all_ops",
    "lorakit.api",
    "lorakit.run",
    "lorakit.prepare",
    "lorakit.merge",
    "lorakit.generate",
    "lorakit.evaluate",
    "lorakit.compare",
    "lorakit.plan",
    "lorakit.backends.deepspeed",
    "lorakit.data.prepare",
    "lorakit.data.examples",
    "lorakit.data.balanced",
    "lorakit.data.causal",
    "lorakit.data.chat",
    "lorakit.data.multipack_seq2seq",
    "lorakit.engine.session",
    "lorakit.engine.job",
    "lorakit.engine.save",
    "lorakit.evaluation.runner",
    "lorakit.model.build",
    "lorakit.model.adapter",
    "lorakit.model.quantize",
    "lorakit.model.untie",
    "lorakit.data.samples",
    "lorakit.observe.tensorboard_sink",
    "lorakit.planner.run_plan",
)


# The client's side (stdlib only: it runs with -S -E), then the harness's, then the server's.
def parse_args(args: list[str]) -> tuple[str, str] | None:
    """(mode, target) of a `python` command line the server can run: ("module", name), ("code", text),
    ("stdin", "-") or ("path", script), after an optional `-u` (unbuffered: torchrun starts its ranks so);
    None for anything else (other interpreter options, no argument)."""
    if args[:1] == ["-u"]:
        args = args[1:]
    if not args:
        return None
    first = args[0]
    if first in ("-m", "-c"):
        return (("module" if first == "-m" else "code"), args[1]) if len(args) > 1 else None
    if first == "-":
        return ("stdin", "-")
    if first.startswith("-"):
        return None
    return ("path", first)


def client(real_python: str, args: list[str]) -> int:
    """Run `python ARGS` in a child of the server, or exec a fresh interpreter when that is not possible."""
    path = os.environ.get(ENV_VAR)
    conn = None
    if path and parse_args(args) is not None:
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(path)
        except OSError:
            conn = None
    if conn is None:
        os.execv(real_python, [real_python, *args])
    request = json.dumps({"args": args, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    fds = array.array("i", [0, 1, 2])
    conn.sendmsg([len(request).to_bytes(8, "big") + request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    for sig in FORWARDED:
        signal.signal(sig, lambda n, _f: conn.sendall(f"sig {n}\n".encode()))
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = conn.recv(64)
        if not chunk:
            print("zygote: the fork server died while running this command", file=sys.stderr)
            return 1
        reply += chunk
    kind, _, value = reply.decode().strip().partition(" ")
    if kind == "fallback":  # the server would not run it exactly like a fresh interpreter
        os.execv(real_python, [real_python, *args])
    if kind == "signal":
        if int(value) not in (signal.SIGKILL, signal.SIGSTOP):  # theirs cannot be changed (nor need be)
            signal.signal(int(value), signal.SIG_DFL)
        os.kill(os.getpid(), int(value))
        return 128 + int(value)
    return int(value)


class Zygote:
    """A running server and the environment that sends the blocks' `python` to it."""

    def __init__(
        self, env: dict[str, str], base: Path, log: Path, warm: tuple[str, ...] = WARM, shims_on_path=True
    ):
        """Start the server (importing `warm`) with `env` plus the shims first on PATH (unless not
        `shims_on_path`: then only commands started with `self.python` reach it) and as PYTHON_EXEC (torchrun
        starts its ranks with it): the environment the blocks get, `self.env`."""
        self._dir = Path(tempfile.mkdtemp(prefix="lorakit-zygote-"))  # short: a socket path has 107 bytes
        self.socket = self._dir / "socket"
        shims = base / "bin"
        shims.mkdir(parents=True, exist_ok=True)
        for name in ("python", "python3"):
            shim = shims / name
            shim.write_text(
                f'#!/bin/sh\nexec "{sys.executable}" -S -E "{Path(__file__).resolve()}" "{sys.executable}" "$@"\n'
            )
            shim.chmod(0o755)
        self.python = str(shims / "python")
        self.env = {**env, ENV_VAR: str(self.socket), "PYTHON_EXEC": self.python}
        if shims_on_path:
            self.env["PATH"] = os.pathsep.join([str(shims), env["PATH"]])
        with open(log, "w") as out:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", SERVE, str(self.socket), *warm],
                env=self.env,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=base,
            )

    def wait_ready(self, timeout: float) -> bool:
        """Whether the server listens (within `timeout` s); until then, and if it died, `python` starts fresh."""
        deadline = time.monotonic() + timeout
        while not self.socket.exists():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def close(self) -> None:
        """Stop the server (closing its stdin ends it; running children are killed) and remove its socket."""
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


def serve(path: str, *warm: str) -> None:
    """Import `warm`, then serve requests on the Unix socket `path` until stdin closes (the harness is done)."""
    import gc
    import importlib
    import selectors

    # What a command's environment must equal, taken before the imports set variables of their own (as
    # they would again in a fresh interpreter, so the children keep them).
    startup_env = dict(os.environ)
    for name in warm:
        try:
            importlib.import_module(name)
        except Exception as e:  # not installed here: a command that needs it pays the import itself
            print(f"zygote: not preloaded {name}: {e}", file=sys.stderr)
    # What the imports set (torch's and others' variables): a command started by a child of this server (a
    # launcher's ranks) inherits them, as a fresh chain's ranks inherit their launcher's.
    imported_env = dict(os.environ)
    # The imported modules live as long as the children: out of every child's collections (each full one walked
    # them, 0.3-1 s, and libraries collect often: DeepSpeed's ZeRO-3 setup, lorakit's group teardown), and
    # their pages shared with the children instead of copied when a collection writes to them.
    gc.freeze()
    parents = Path(path).parent / "parents"  # a child's fresh_parent, written by the child
    parents.mkdir(exist_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(16)
    os.rename(path + ".tmp", path)  # clients connect only once it listens
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(sys.stdin, selectors.EVENT_READ, "stdin")
    running: dict[int, tuple[socket.socket, int]] = {}  # child pid -> (its client's connection, pidfd)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        while True:
            for key, _ in sel.select():
                what = key.data
                if what == "stdin":
                    return
                if what == "accept":
                    conn, _ = listener.accept()
                    try:
                        pid = _start(conn, listener, (startup_env, imported_env), running)
                    except (OSError, ValueError):  # a client that died while sending: nothing to run
                        conn.close()
                        continue
                    if pid is not None:
                        pidfd = os.pidfd_open(pid)
                        running[pid] = (conn, pidfd)
                        sel.register(conn, selectors.EVENT_READ, ("client", pid))
                        sel.register(pidfd, selectors.EVENT_READ, ("child", pid))
                elif what[0] == "client":
                    _from_client(what[1], running)
                else:
                    pid = what[1]
                    conn, pidfd = running.pop(pid)
                    sel.unregister(conn)
                    sel.unregister(pidfd)
                    os.close(pidfd)
                    _, status = os.waitpid(pid, 0)
                    (parents / str(pid)).unlink(missing_ok=True)
                    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
                    reply = f"signal {sig}\n" if sig else f"exit {os.WEXITSTATUS(status)}\n"
                    with contextlib.suppress(OSError):  # a killed client: nobody to tell
                        conn.sendall(reply.encode())
                    conn.close()
    finally:
        for pid in running:
            _kill_group(pid, signal.SIGKILL)
        os.unlink(path)


def env_differs(env: dict, startup: dict, imported: dict) -> list[str]:
    """The variables (outside what a child sets per command, `per_command`) for which a command's `env` is
    not the server's: each must hold the server's value at start (`startup`) or, for what the server's
    imports set (`imported`: torch's, a launcher's children inherit them, and so does a test process that
    imported the same libraries later), the value those imports gave it."""
    keys = (env.keys() | startup.keys() | imported.keys()) - per_command(env, startup)
    return sorted(k for k in keys if env.get(k) not in (startup.get(k), imported.get(k)))


def per_command(env: dict, startup: dict) -> set[str]:
    """The variables a served child takes from its command's `env`: PER_COMMAND; a lazy library's while the
    server has not imported it; and, when the command only puts directories before the server's PYTHONPATH
    (added_paths), PYTHONPATH and the startup hook's switches."""
    names = set(PER_COMMAND)
    names |= {
        k for k in env if any(k.startswith(p) and m not in sys.modules for p, m in LAZY_LIBRARIES.items())
    }
    if added_paths(env, startup) is not None:
        names |= STARTUP_SWITCHES | {"PYTHONPATH"}
    return names


def added_paths(env: dict, startup: dict) -> list[str] | None:
    """The directories a command's PYTHONPATH puts before the server's (`startup`'s), which a served child
    puts on sys.path where a fresh interpreter would (and runs a sitecustomize among them); None when it
    changes the server's entries otherwise, or when one holds a module the server has imported (a fresh
    interpreter would import that directory's: a stand-in that hides bitsandbytes, a second sitecustomize)."""
    ours = [p for p in startup.get("PYTHONPATH", "").split(os.pathsep) if p]
    theirs = list(dict.fromkeys(env.get("PYTHONPATH", "").split(os.pathsep)))
    added = [p for p in theirs if p not in ours]
    if [p for p in theirs if p] != added + list(dict.fromkeys(ours)) or "" in added:
        return None
    for directory in added:
        with contextlib.suppress(OSError):
            if any(name.split(".")[0] in sys.modules for name in os.listdir(directory)):
                return None
    return added


def fresh_parent(pid: int) -> int:
    """The parent process `pid` would have as a fresh interpreter: for a child of the server, the process that
    ran its `python` (its client's parent); else its parent. Fault injection finds a rank's torchrun and
    launcher so."""
    server = os.environ.get(ENV_VAR)
    if server:
        with contextlib.suppress(OSError, ValueError):
            return int((Path(server).parent / "parents" / str(pid)).read_text())
    return _proc_parent(pid)


def _proc_parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _start(conn, listener, server_envs: tuple[dict, dict], running: dict) -> int | None:
    """Receive a request and fork its child; None when the client was told to run a fresh interpreter."""
    header, fds = _recv_fds(conn, 8)
    size = int.from_bytes(header, "big") if len(header) == 8 else 0
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            break
        body += chunk
    if len(fds) != 3 or len(body) != size:
        for fd in fds:
            os.close(fd)
        conn.close()
        return None
    request = json.loads(body)
    differ = env_differs(request["env"], *server_envs)
    if differ or parse_args(request["args"]) is None:
        print(
            "zygote: fresh interpreter for",
            request["args"][:3],
            f"(environment differs: {differ})" if differ else "",
        )
        for fd in fds:
            os.close(fd)
        conn.sendall(b"fallback\n")
        conn.close()
        return None
    request["per_command"] = sorted(per_command(request["env"], server_envs[0]))
    request["added_paths"] = added_paths(request["env"], server_envs[0]) or []
    client = struct.unpack(
        "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    )
    try:
        request["parent"] = _proc_parent(client[0])
    except OSError:  # the client died while sending: nothing to run
        for fd in fds:
            os.close(fd)
        conn.close()
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            listener.close()
            conn.close()
            for other, pidfd in running.values():
                other.close()
                os.close(pidfd)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            code = _child(request)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        os._exit(code)
    for fd in fds:
        os.close(fd)  # the child has them: a pipe must close when the child and the client are done
    return pid


def _recv_fds(conn, size: int) -> tuple[bytes, list[int]]:
    fds = array.array("i")
    data, ancdata, _, _ = conn.recvmsg(size, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds)


def _from_client(pid: int, running: dict) -> None:
    """A forwarded signal, or EOF: the client died (a block's timeout), so its command dies with it. A command
    already reaped is done (its exit and its client's EOF can come in one batch of events, the exit first)."""
    if pid not in running:
        return
    conn, _ = running[pid]
    try:
        data = conn.recv(256)
    except OSError:
        data = b""
    if not data:
        _kill_group(pid, signal.SIGKILL)
        return
    for line in data.decode().splitlines():
        if line.startswith("sig "):
            _kill_group(pid, int(line.split()[1]))


def _kill_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def _child(request: dict) -> int:
    """Run the command in this forked child as `python ARGS` would, and return its exit code."""
    import atexit
    import runpy
    import threading
    import types

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    for name in request["per_command"]:  # the rest equals the server's (before or after its imports)
        if name in request["env"]:
            os.environ[name] = request["env"][name]
        else:
            os.environ.pop(name, None)
    (Path(os.environ[ENV_VAR]).parent / "parents" / str(os.getpid())).write_text(str(request["parent"]))
    args = request["args"]
    mode, target = parse_args(args)
    if args[0] == "-u":
        args = args[1:]
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=True)
    for name in [m for m in sys.modules if m == "tests" or m.startswith("tests.")]:
        del sys.modules[name]  # the server's own modules: a fresh interpreter has not imported them
    # The command's own PYTHONPATH entries, where site puts them (after the script's directory), and the
    # startup hook among them, which site runs before the command.
    sys.path[1:1] = request["added_paths"]
    if any(os.path.exists(os.path.join(p, "sitecustomize.py")) for p in request["added_paths"]):
        import importlib

        importlib.import_module("sitecustomize")
    code, interrupted = 0, False
    try:
        if mode == "module":
            # Preloaded, the module would be run beside its imported copy (runpy warns); a fresh interpreter
            # has only the copy it runs.
            sys.modules.pop(target, None)
            sys.argv = [args[0], *args[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif mode == "path":
            sys.argv = list(args)
            sys.path[0] = os.path.dirname(os.path.realpath(target))
            runpy.run_path(target, run_name="__main__")
        else:
            sys.argv = ["-c", *args[2:]] if mode == "code" else list(args)
            sys.path[0] = ""
            source = target if mode == "code" else sys.stdin.read()
            main = types.ModuleType("__main__")
            main.__dict__["__builtins__"] = __builtins__
            sys.modules["__main__"] = main
            exec(compile(source, "<string>" if mode == "code" else "<stdin>", "exec"), main.__dict__)
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        interrupted = True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # as at interpreter exit: wait for the command's non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:  # as the interpreter does: die of SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _exit_code(code) -> int:
    """The exit status SystemExit(code) gives, as the interpreter computes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    # The shim: python -S -E zygote.py REAL_PYTHON ARGS...
    sys.exit(client(sys.argv[1], sys.argv[2:]))
