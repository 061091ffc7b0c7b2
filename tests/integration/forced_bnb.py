"""Launches with bitsandbytes' AVX512-BF16 answer forced (tests/bnb_layout.py), served warm.

The session's fork server (tests/conftest.py warm_interpreters) imported bitsandbytes unforced, so a launch
with LORAKIT_BNB_AVX512BF16 set cannot be forked from it: the server refuses an environment other than its
own, and such a launch used to start every process fresh (`python -m lorakit.run`, its agent, each rank:
~10 CPU-seconds of imports each, ~40 a launch). `forced_server` starts a second instance of the same server
(tests/docs/zygote.py) whose environment forces the answer: faults/sitecustomize.py forces it as the server
imports bitsandbytes, before bitsandbytes registers its CPU kernels, exactly as in a fresh process, and every
process it forks (the launcher, the agent, the ranks: PYTHON_EXEC) inherits that. LORAKIT_TEST_ZYGOTE=0
launches fresh instead, as the session's server does then.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.bnb_layout import ENV as AVX512BF16_ENV
from tests.conftest import ROOT

FAULTS = Path(__file__).parent / "faults"


def forced_vars(flag: str = "1") -> dict[str, str]:
    """The variables that force the answer in a process's sitecustomize.py (faults/ first on the path)."""
    return {AVX512BF16_ENV: flag, "PYTHONPATH": os.pathsep.join([str(FAULTS), str(ROOT)])}


# For launches in fresh interpreters, added to the caller's environment (test_fsdp.py's).
FORCED_ENV = forced_vars("1")


@dataclass(frozen=True)
class Forced:
    """The interpreter to launch with (the server's shim, or this one when off) and its environment."""

    python: str
    env: dict[str, str]


def forced_env(flag: str = "1") -> dict[str, str]:
    """A launch's environment with the answer forced: the launcher's (launch_env), none of the session
    server's routing or of the caller's trackers, and faults/ on the path for sitecustomize.py."""
    from lorakit.engine.launch import launch_env
    from tests.docs.zygote import ENV_VAR

    env = {
        k: v
        for k, v in launch_env().items()
        if k not in (ENV_VAR, "PYTHON_EXEC", "LORAKIT_FAULT") and not k.startswith(("WANDB_", "MLFLOW_"))
    }
    return env | forced_vars(flag)


@contextlib.contextmanager
def forced_server(base: Path, flag: str = "1") -> Iterator[Forced]:
    """A fork server whose processes see AVX512-BF16 as `flag` says, for the duration of the block."""
    env = forced_env(flag)
    if os.environ.get("LORAKIT_TEST_ZYGOTE") == "0":
        yield Forced(sys.executable, env)
        return
    from tests.docs.zygote import Zygote

    zygote = Zygote(env, base, log=base / "zygote.log", shims_on_path=False)
    try:
        # Until the server listens its shim starts fresh interpreters: the first launch would pay its imports.
        zygote.wait_ready(300)
        forced = Forced(zygote.python, zygote.env)
        _check_forced(forced, flag)
        yield forced
    finally:
        zygote.close()


def _check_forced(forced: Forced, flag: str) -> None:
    """A process of `forced` reads bitsandbytes' answer as `flag`: the server's imports took the forcing."""
    code = "from bitsandbytes.cextension import lib; print(int(lib.has_avx512bf16_cpu()))"
    proc = subprocess.run(
        [forced.python, "-c", code], env=forced.env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.stdout.strip() == flag, f"bitsandbytes' AVX512-BF16 answer not forced:\n{proc.stderr[-3000:]}"


def launch(forced: Forced, recipe: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m lorakit.run RECIPE` to the end, in a process group of its own, forced as `forced` is."""
    from tests.process_groups import finish_group, start_group

    proc = start_group([forced.python, "-m", "lorakit.run", str(recipe)], forced.env, ROOT)
    return finish_group(proc, timeout)
