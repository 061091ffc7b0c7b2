"""The doc-test fork server: a `python` command served by a forked child behaves like a fresh interpreter
(arguments, stdin, output, exit codes, errors), what it cannot serve exactly runs in a fresh one, and a
killed command (a block's timeout) takes its child with it. The server here preloads one small stdlib module,
so whether a command was served shows in `sys.modules`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import types

import pytest

from tests.docs.harness import doc_env, run_page
from tests.docs.zygote import ENV_VAR, Zygote, _from_client, added_paths, env_differs, parse_args

MARK = "xml.dom.minidom"  # preloaded by the server: in sys.modules only in a served command
SERVED = f"import sys; print('served' if {MARK!r} in sys.modules else 'fresh')"


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    base = tmp_path_factory.mktemp("zygote")
    (base / "home").mkdir()
    z = Zygote(doc_env(base / "home"), base, log=base / "zygote.log", warm=(MARK,))
    assert z.wait_ready(timeout=60), (base / "zygote.log").read_text()
    yield z
    z.close()


def bash(zygote, script: str, cwd, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=cwd,
        env=env or zygote.env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_parse_args_serves_only_plain_command_lines():
    assert parse_args(["-m", "lorakit.run", "r.yaml"]) == ("module", "lorakit.run")
    assert parse_args(["-c", "print(1)", "x"]) == ("code", "print(1)")
    assert parse_args(["-", "x"]) == ("stdin", "-")
    assert parse_args(["script.py", "-m"]) == ("path", "script.py")
    # -u: torchrun starts its ranks unbuffered.
    assert parse_args(["-u", "-m", "lorakit.run", "r.yaml"]) == ("module", "lorakit.run")
    assert parse_args([]) is None and parse_args(["-B", "x.py"]) is None and parse_args(["-m"]) is None
    assert parse_args(["-u"]) is None and parse_args(["-u", "-B", "x.py"]) is None


def test_a_command_is_served_only_with_the_servers_environment():
    startup = {"PATH": "/bin", "HOME": "/h"}
    imported = {**startup, "TORCHINDUCTOR_CACHE_DIR": "/tmp/ti", "SESSION_ID": "abc"}  # set by its imports
    assert env_differs(dict(startup), startup, imported) == []
    assert env_differs(dict(imported), startup, imported) == []  # a served launcher's ranks
    # A test process that imported one of the same libraries later: that variable, at the imports' value.
    assert env_differs({**startup, "TORCHINDUCTOR_CACHE_DIR": "/tmp/ti"}, startup, imported) == []
    assert env_differs({**startup, "TORCHINDUCTOR_CACHE_DIR": "/x"}, startup, imported) == [
        "TORCHINDUCTOR_CACHE_DIR"
    ]
    assert env_differs({**startup, "FOO": "1"}, startup, imported) == ["FOO"]
    assert env_differs({"PATH": "/bin"}, startup, imported) == ["HOME"]
    assert env_differs({**startup, "RANK": "1", "PWD": "/w"}, startup, imported) == []  # per command
    # Set in the test process by an in-process run (lorakit's MLflow sink), read only when used: per command,
    # so one in-process test does not send its worker's later launches to fresh interpreters.
    assert (
        env_differs({**startup, "MLFLOW_ALLOW_FILE_STORE": "true", "COLUMNS": "80"}, startup, imported) == []
    )
    # Set by llama.cpp's library as a GGUF test loads it in the test process: before, every later launch of
    # that xdist worker (compare, doctor, the 2-process runs) went to fresh interpreters, 9 in one run.
    assert env_differs({**startup, "KMP_BLOCKTIME": "1"}, startup, imported) == []
    # Set by a test for its run, read by the preloaded mlflow at each use (test_resume's failing trackers).
    assert env_differs({**startup, "MLFLOW_TRACKING_URI": "http://127.0.0.1:9"}, startup, imported) == []


def test_a_startup_hook_on_an_added_path_is_per_command(tmp_path, monkeypatch):
    startup = {"PATH": "/bin", "PYTHONPATH": "/repo"}
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text("")
    faulty = {**startup, "PYTHONPATH": f"{hook}:/repo:/repo", "LORAKIT_FAULT": "kill:3"}
    assert added_paths(faulty, startup) == [str(hook)] and env_differs(faulty, startup, startup) == []
    # Only directories put before the server's: a command that drops or reorders its entries is fresh, and
    # so is a switch of the hook without the hook's directory (nothing to run it there: a fresh interpreter).
    assert added_paths({**faulty, "PYTHONPATH": f"/repo:{hook}"}, startup) is None
    assert added_paths({**faulty, "PYTHONPATH": str(hook)}, startup) is None
    assert env_differs({**faulty, "PYTHONPATH": f"/repo:{hook}"}, startup, startup) == [
        "LORAKIT_FAULT",
        "PYTHONPATH",
    ]
    # A directory that holds a module the server has imported: a fresh interpreter would take the directory's
    # (tests/e2e/test_qlora_errors.py hides bitsandbytes so; served, the run trained with the real one).
    stand_in = tmp_path / "stand-in" / "json"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text("raise ModuleNotFoundError('json')\n")
    hidden = {**startup, "PYTHONPATH": f"{stand_in.parent}:/repo"}
    assert added_paths(hidden, startup) is None and env_differs(hidden, startup, startup) == ["PYTHONPATH"]
    # bitsandbytes' forced branch acts before bitsandbytes registers its kernels: never served.
    assert env_differs({**faulty, "LORAKIT_BNB_AVX512BF16": "1"}, startup, startup) == [
        "LORAKIT_BNB_AVX512BF16"
    ]
    # W&B's variables, read by wandb once imported: per command while the server has not imported it, a
    # difference once it has. Both set here: this process's modules depend on what ran before in the worker
    # (CI's gw1 had imported wandb, and the check read that instead of the rule).
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    assert env_differs({**startup, "WANDB_MODE": "offline"}, startup, startup) == []
    monkeypatch.setitem(sys.modules, "wandb", types.ModuleType("wandb"))
    assert env_differs({**startup, "WANDB_MODE": "offline"}, startup, startup) == ["WANDB_MODE"]


@pytest.mark.slow
def test_a_served_command_runs_its_startup_hook_and_knows_its_fresh_parent(zygote, tmp_path):
    # What the resume tests' fault injection needs (tests/integration/faults/sitecustomize.py): the hook on
    # the command's PYTHONPATH runs in the served child, with the command's switches, before the command; a
    # served child's parent, as a fresh interpreter's, is the shell that ran `python` (not the server).
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text("import os\nprint('hook', os.environ.get('LORAKIT_FAULT'))\n")
    server_path = zygote.env["PYTHONPATH"]
    done = bash(
        zygote,
        f'PYTHONPATH={hook}:{server_path} LORAKIT_FAULT=term:2 python -c "{SERVED}; import os; '
        'from tests.docs.zygote import fresh_parent; print(sys.path[1], fresh_parent(os.getpid()))"; echo $$',
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    hook_line, served, path_and_parent, shell = done.stdout.splitlines()
    assert (hook_line, served) == ("hook term:2", "served")
    assert path_and_parent == f"{hook} {shell}"


@pytest.mark.slow
def test_served_commands_behave_like_a_fresh_interpreter(zygote, tmp_path):
    (tmp_path / "s.py").write_text(SERVED + "\nprint(__name__, sys.argv, sys.path[0])\n")
    (tmp_path / "mod.py").write_text(SERVED + "\nprint(__name__, sys.argv[1:], sys.path[0])\n")
    script = "\n".join(
        [
            f'python -c "{SERVED}; print(sys.argv, repr(sys.path[0]))" a b',
            "python s.py q",
            "python -m mod r",
            "python - x <<'EOF'",
            SERVED + "; import os; print(sys.argv, sys.stdin.read() == '', os.getcwd())",
            "EOF",
            "python -c \"import sys; print('to stderr', file=sys.stderr)\"",
            'echo \'{"a": 1}\' | python -c "import json, sys; print(json.load(sys.stdin))"',
            "cd .. && python -c 'import os; print(os.environ[\"PWD\"] == os.getcwd())'",
            f"MLFLOW_ALLOW_FILE_STORE=true python -c \"{SERVED}; import os; print(os.environ['MLFLOW_ALLOW_FILE_STORE'])\"",
        ]
    )
    done = bash(zygote, script, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "served",
        "['-c', 'a', 'b'] ''",
        "served",
        f"__main__ ['s.py', 'q'] {tmp_path}",
        "served",
        f"__main__ ['r'] {tmp_path}",
        "served",
        f"['-', 'x'] True {tmp_path}",
        "{'a': 1}",
        "True",  # bash's own variables are the command's
        "served",
        "true",  # set while working (SET_WHILE_WORKING): the client's value
    ]
    assert done.stderr == "to stderr\n"


@pytest.mark.slow  # launches an interpreter
def test_failures_keep_their_exit_status(zygote, tmp_path):
    assert bash(zygote, "python -c 'import sys; sys.exit(3)'", tmp_path).returncode == 3
    assert bash(zygote, "python -c 'import sys; sys.exit(\"bad input\")'", tmp_path).stderr == "bad input\n"
    raised = bash(zygote, "python -c 'raise ValueError(\"boom\")'", tmp_path)
    assert raised.returncode == 1 and "ValueError: boom" in raised.stderr and "Traceback" in raised.stderr
    killed = bash(
        zygote, "python -c 'import os, signal; os.kill(os.getpid(), signal.SIGTERM)'; echo no", tmp_path
    )
    assert killed.returncode == 128 + signal.SIGTERM and "no" not in killed.stdout
    # SIGKILL (the out-of-memory killer's, a fault test's): the client dies of it too, not of an error of its
    # own while resetting a handler SIGKILL cannot have (a resume test's rank then read "exited with code 1").
    sigkilled = bash(
        zygote, "python -c 'import os, signal; os.kill(os.getpid(), signal.SIGKILL)'; echo no", tmp_path
    )
    assert sigkilled.returncode == 128 + signal.SIGKILL and "Traceback" not in sigkilled.stderr, (
        sigkilled.stderr
    )
    # Interpreter exit: non-daemon threads are waited for, then atexit handlers run.
    ended = bash(
        zygote,
        'python -c \'import atexit, threading, time; atexit.register(print, "atexit"); '
        'threading.Thread(target=lambda: (time.sleep(0.5), print("thread"))).start()\'',
        tmp_path,
    )
    assert ended.stdout.splitlines() == ["thread", "atexit"]


@pytest.mark.slow  # launches an interpreter
def test_what_it_cannot_serve_runs_in_a_fresh_interpreter(zygote, tmp_path):
    changed = bash(zygote, f'FOO=1 python -c "{SERVED}"; python -B -c "{SERVED}"', tmp_path)
    assert changed.stdout.split() == ["fresh", "fresh"]
    # What torchrun sets for a rank is read at run time: served, with the rank's values; -u (how torchrun
    # starts a rank): served, its streams writing through as `python -u`'s do.
    rank = bash(
        zygote,
        f'RANK=1 MASTER_PORT=29999 python -u -c "{SERVED}; import os, sys; '
        "print(os.environ['RANK'], os.environ['MASTER_PORT'], sys.stdout.write_through)\"",
        tmp_path,
    )
    assert rank.stdout.split() == ["served", "1", "29999", "True"], rank.stderr
    down = bash(
        zygote, f'python -c "{SERVED}"', tmp_path, env={**zygote.env, ENV_VAR: str(tmp_path / "none")}
    )
    assert down.returncode == 0 and down.stdout.split() == ["fresh"]


@pytest.mark.slow  # launches an interpreter
def test_a_killed_command_takes_its_child_with_it(zygote, tmp_path):
    proc = subprocess.Popen(
        [
            "bash",
            "-c",
            'python -c \'import os, time; open("pid", "w").write(str(os.getpid())); time.sleep(60)\'',
        ],
        cwd=tmp_path,
        env=zygote.env,
        start_new_session=True,
    )
    pid_file = tmp_path / "pid"
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    child = int(pid_file.read_text())
    assert child != proc.pid
    os.killpg(proc.pid, signal.SIGKILL)  # what the harness does at a block's timeout
    proc.wait()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{child}") and _state(child) != "Z":
        assert time.monotonic() < deadline, "the served command outlived its killed client"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_an_event_of_a_command_already_reaped_is_ignored():
    # The server handles a batch of events in order: a child's exit (reaped, removed from `running`) may come
    # before its client's EOF in the same batch. That EOF stopped the server with a KeyError in the full
    # suite, and every later command ran in a fresh interpreter.
    _from_client(12345, running={})


@pytest.mark.slow
def test_a_page_served_by_it_still_fails_at_its_failing_block(zygote, tmp_path):
    # The wiring test_docs.py uses: python blocks and bash's `python` through the server's shims.
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nimport sys\n" + SERVED + "\n```\n\n"
        "```bash\npython -c 'import sys; sys.exit(4)'\necho never\n```\n\n"
        "```python\nprint('not reached')\n```\n"
    )
    result = run_page(page, tmp_path / "work", zygote.env, 60, python=zygote.python)
    assert [r.returncode for r in result.results] == [0, 4]
    assert result.results[0].output == "served\n" and "never" not in result.results[1].output
    hung = tmp_path / "hung.md"
    hung.write_text("```bash\npython -c 'import time; time.sleep(60)'\n```\n")
    result = run_page(hung, tmp_path / "work2", zygote.env, 2, python=zygote.python)
    assert result.failed is not None and result.failed.timed_out
    # The killed command's exit and its client's EOF did not stop the server: the next command is served.
    after = tmp_path / "after.md"
    after.write_text("```python\n" + SERVED + "\n```\n")
    assert (
        run_page(after, tmp_path / "work3", zygote.env, 60, python=zygote.python).results[0].output
        == "served\n"
    )
