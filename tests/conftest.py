"""Shared fixtures: a per-session lorakit cache (tiny models, tokenized data) and recipe builders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.zygote import ENV_VAR as ZYGOTE_ENV_VAR

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"

# One OpenMP thread per process (the test processes and every process they start): tests run on 2 cores with
# 2 xdist workers beside 2-process launches, where torch's default (a thread per core) oversubscribes the
# cores and the tiny models' ops spend their time waiting for threads (one DPO unit test: 0.6 CPU-seconds
# with 1 thread, 17-22 with 2, on a loaded machine). Before torch is imported; a value already set wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def run_cli(
    module: str, *args, timeout: float = 900, fresh: bool = False, **options
) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS...` from the repository root, output captured as text; `options` go to
    subprocess.run (env, start_new_session). The interpreter is forked from the session's warm one (see
    warm_interpreters) unless `fresh`: a test of what happens at import (a quiet console) starts it anew, and
    so do the processes it launches."""
    python = sys.executable if fresh or _warm["python"] is None else _warm["python"]
    if fresh:
        env = dict(options.pop("env", None) or os.environ)
        for name in ("PYTHON_EXEC", ZYGOTE_ENV_VAR):
            env.pop(name, None)
        options["env"] = env
    return subprocess.run(
        [python, "-m", module, *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        **options,
    )


# Warm interpreters: a `python` started by run_cli, and every rank torchrun starts (PYTHON_EXEC, which lorakit's
# launcher reads too), is a child forked from one server per test process that imported torch, transformers,
# DeepSpeed and lorakit once (tests/docs/zygote.py, the suite's one fork server): about 12 CPU-seconds of
# imports saved per process, 3-4 processes per 2-process run. The server serves a command only when its
# environment is the session's (plus what torchrun sets for a rank, and the switches of the fault injection's
# sitecustomize, which a served child runs: zygote.per_command), so a test that otherwise changes the
# environment (forced CPU branches, LORAKIT_* switches) gets fresh interpreters, as does any command with
# interpreter options. LORAKIT_TEST_ZYGOTE=0 turns it off.
_warm: dict = {"python": None}


@pytest.fixture(scope="session", autouse=True)
def warm_interpreters(request, tmp_path_factory):
    """The session's fork server, when this test process runs tests that launch processes (marked slow:
    pytest_collection_modifyitems marks SLOW_DIRS' too)."""
    if os.environ.get("LORAKIT_TEST_ZYGOTE") == "0" or not any(
        item.get_closest_marker("slow") for item in request.session.items
    ):
        yield None
        return
    from lorakit.engine.launch import launch_env
    from tests.docs.zygote import Zygote

    base = tmp_path_factory.mktemp("zygote")
    # What the ranks' environment holds in any case (lorakit's launcher sets it for torchrun), and the
    # repository on the path (as the tests that launch scripts of tests/ set it): the server starts with it.
    env = launch_env()
    if env.get("PYTHONPATH", str(ROOT)) == str(ROOT):
        env["PYTHONPATH"] = str(ROOT)
    zygote = Zygote(env, base, log=base / "zygote.log", shims_on_path=False)
    # Until it listens every command starts fresh, silently: a worker's first launch raced it (test_faults'
    # harness: 130 CPU-seconds instead of 62). Its imports take the CPU the first test would have had anyway.
    zygote.wait_ready(timeout=180)
    saved = dict(os.environ)
    os.environ.update(zygote.env)
    _warm["python"] = zygote.python
    try:
        yield zygote
    finally:
        _warm["python"] = None
        os.environ.clear()
        os.environ.update(saved)
        zygote.close()


# Test files whose tests share a session fixture go to one xdist worker together, so the fixture is built once
# (every other file goes alone, as --dist loadfile sends it): the files that use tests/e2e/conftest.py's
# mnli_run and mnli_merged.
SHARED_UNITS = {
    "tests/e2e/test_generate.py": "tests/e2e/conftest.py::mnli_run",
    "tests/e2e/test_evaluate.py": "tests/e2e/conftest.py::mnli_run",
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile (pyproject.toml), with the files of SHARED_UNITS scheduled as one unit each, in the
    order of the collection (heaviest first: pytest_collection_modifyitems), not xdist's (most tests first,
    which left the files of one long test, the quickstarts, for the end of the run)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedFixtureScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit_of(super()._split_scope(nodeid))

    config.option.loadscopereorder = False
    return SharedFixtureScheduling(config, log)


# Seconds each test file took (its tests' setup, call and teardown) in a whole run on 2 cores: the suite runs
# the heaviest first, so the two workers end together. LORAKIT_RECORD_DURATIONS=PATH writes a new table at the
# end of a run; a file not in it counts as light.
DURATIONS = Path(__file__).parent / "durations.json"
_durations: dict[str, float] = {}


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _unit_of(path: str) -> str:
    """The scheduling unit of a test file: its SHARED_UNITS unit, or the file itself."""
    return SHARED_UNITS.get(path, path)


def pytest_runtest_logreport(report):
    if os.environ.get("LORAKIT_RECORD_DURATIONS"):
        path = _file_of(report.nodeid)
        _durations[path] = _durations.get(path, 0.0) + report.duration


def pytest_sessionfinish(session):
    target = os.environ.get("LORAKIT_RECORD_DURATIONS")
    if target and _durations and not hasattr(session.config, "workerinput"):  # the controller (or -n 0)
        table = {k: round(v, 1) for k, v in sorted(_durations.items(), key=lambda kv: -kv[1])}
        Path(target).write_text(json.dumps(table, indent=1) + "\n")


# The fast lane (`-m "not slow"`, docs/contributing.md#tests) runs no process launch: a test that starts a
# Python interpreter, torchrun or DeepSpeed's launcher is marked `slow` (a launch costs 5-60 s), as is
# everything under SLOW_DIRS. Whether a
# test did is seen by an audit hook (subprocess.Popen's event), so a mark that is missing fails that lane.
LAUNCHERS = ("python", "torchrun", "deepspeed", "accelerate")
_launches: list[str] = []


def _record_launch(event: str, args: tuple) -> None:
    if event == "subprocess.Popen":
        argv = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
        program = os.path.basename(str(args[0] or argv[0]).split()[0])
        if program.startswith(LAUNCHERS) or program == os.path.basename(sys.executable):
            _launches.append(" ".join(map(str, argv))[:200])


# Directories whose every test trains a model end to end or runs a command: the full lane only.
SLOW_DIRS = ("tests/integration/", "tests/e2e/")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(SLOW_DIRS):
            item.add_marker(pytest.mark.slow)
    # Heaviest files first (DURATIONS), each file's tests in their own order; a shared unit's files by their sum.
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    unit_seconds: dict[str, float] = {}
    for path, took in seconds.items():
        unit_seconds[_unit_of(path)] = unit_seconds.get(_unit_of(path), 0.0) + took
    items.sort(key=lambda item: -unit_seconds.get(_unit_of(_file_of(item.nodeid)), 0.0))  # stable


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, the test modules) lives as long as the test process: out
    of its collections from here on (gc.freeze), as the fork server's imports are out of its children's. A
    full collection walked all of it (0.3 s and up), and models built in tests trigger them often."""
    import gc

    gc.freeze()


def pytest_configure(config):
    if "not slow" in (config.getoption("markexpr", "") or ""):
        sys.addaudithook(_record_launch)
    if "torch" in sys.modules:  # imported before this file (by a plugin): OMP_NUM_THREADS came too late
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    del _launches[:]  # before any fixture: a module or session fixture's launch counts for its first test


@pytest.fixture(autouse=True)
def _unmarked_launches_fail_the_fast_lane(request):
    """In the fast lane, a test not marked `slow` that launched a process fails, naming the command."""
    yield
    if _launches and request.node.get_closest_marker("slow") is None:
        launched, _launches[:] = list(_launches), []
        pytest.fail(
            f"launched {launched[0]!r} (and {len(launched) - 1} more): mark the test slow", pytrace=False
        )


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One cache for the whole session, so the tiny T5 is built once."""
    return tmp_path_factory.mktemp("lorakit-cache")


def tiny_recipe_dict(cache_dir: Path, out_dir: Path, **sections) -> dict:
    """A small, fast seq2seq recipe on the tiny T5 and the builtin news data; sections override keys."""
    raw = {
        "model": {"name_or_path": "tiny:t5", "dtype": "float32", "gradient_checkpointing": False},
        "method": {"kind": "lora", "r": 4, "alpha": 8, "dropout": 0.0},
        "data": {
            "source": "builtin:news_summaries",
            "input_column": "article",
            "target_column": "highlights",
            "prompt_template": "Summarize the following news article:\n{input}\nSummary:\n",
            "max_samples": 32,
            "max_eval_samples": 8,
            "max_source_length": 96,
            "max_target_length": 24,
            "cache_dir": str(cache_dir),
        },
        "train": {"epochs": 1, "lr": 3e-3, "micro_batch_size": 4, "warmup_ratio": 0.0},
        "distributed": {"num_processes": 1, "zero_stage": 0},
        "eval": {"metrics": ["rouge"], "max_new_tokens": 8},
        "output": {"dir": str(out_dir)},
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return raw


def tiny_recipe(cache_dir: Path, out_dir: Path, **sections):
    """tiny_recipe_dict validated into a frozen Recipe."""
    from lorakit.recipe import recipe_from_dict

    return recipe_from_dict(tiny_recipe_dict(cache_dir, out_dir, **sections))


def rows_recipe(
    cache_dir: Path, tmp_path: Path, rows: list[dict], objective: str, model: str = "tiny:llama", **sections
):
    """tiny_recipe training `objective` on `rows` (written to tmp_path/rows.jsonl: data.source) without eval;
    `sections` override keys (data's on top of the source)."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sections["data"] = {"source": str(path), **sections.get("data", {})}
    return tiny_recipe(
        cache_dir,
        tmp_path / "run",
        model={"name_or_path": model},
        train={"objective": objective},
        eval={"enabled": False},
        **sections,
    )


# How packed rows are isolated: per-example SDPA (what packed recipes load for sdpa), or explicit 4-D masks
# (sdpa loaded without packing, and eager).
PACKING_BACKENDS = {"varlen_sdpa": ("sdpa", True), "sdpa_mask": ("sdpa", False), "eager": ("eager", False)}


def training_config_model(cache_dir: Path, out_dir: Path, backend: str, **model):
    """A tiny model built as training builds it (gradient checkpointing, LoRA) with a non-zero adapter
    update and dropout off (random per token, so no two forwards would agree), in train mode."""

    from lorakit.model import build_model
    from lorakit.recipe import recipe_from_dict

    attention, packing = PACKING_BACKENDS[backend]
    recipe = recipe_from_dict(
        tiny_recipe_dict(
            cache_dir,
            out_dir,
            model={"attention": attention, "gradient_checkpointing": True, **model},
            method={"dropout": 0.0},
            data={"packing": packing},
        )
    )
    built = build_model(recipe)
    assert built.attention == ("lorakit_varlen_sdpa" if backend == "varlen_sdpa" else attention)
    return ready_for_contract(built)


def ready_for_contract(built):
    """`built` (a BuiltModel) with a non-zero LoRA update, dropout off and in train mode: what the packing
    contract tests compare (the doctor's contracts prepare their model the same way). Attention-probability
    dropout is already off by default (model.attention_dropout 0, as users get it)."""
    from lorakit.doctor.contracts import prepare_for_contract

    return prepare_for_contract(built)


def losses_and_grads(built, rows, collators, *, per_token: bool = True) -> list[tuple[float, int, dict]]:
    """For each collator, `rows` as its one batch through ModelInputs.logits (as the loop calls it):
    (loss, target tokens, gradient of every weight that got one). The loss is the token loss sum, divided by
    the target tokens when `per_token`."""
    from lorakit.model.loss import token_loss_sum

    results = []
    for collate in collators:
        built.model.zero_grad()
        batch = collate(rows)
        logits = built.inputs.logits(built.model, batch, "cpu")
        loss = token_loss_sum(logits, batch["labels"])
        if per_token:
            loss = loss / batch["num_target_tokens"]
        loss.backward()
        grads = {n: p.grad.clone() for n, p in built.model.named_parameters() if p.grad is not None}
        results.append((loss.item(), batch["num_target_tokens"], grads))
    return results
