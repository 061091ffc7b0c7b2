"""Backends as a type: both engines answer lorakit's Engine verbs with the Protocol's signatures, both
backends are Backends, the registry is keyed by distributed.strategy, and the job, the loop, saving and
checkpoints speak only the Protocol (no backend's vocabulary, no probing of the engine)."""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lorakit.backends import BACKENDS, Backend, Engine
from lorakit.backends.deepspeed import DeepSpeedBackend, DeepSpeedEngine
from lorakit.backends.fsdp import FsdpBackend, FsdpEngine
from lorakit.recipe.schema import DistributedSection
from tests.conftest import tiny_recipe

ENGINE_DIR = Path(__file__).resolve().parents[2] / "lorakit" / "engine"


def _members(protocol) -> list[str]:
    return sorted(n for n in protocol.__dict__ if not n.startswith("_") and callable(protocol.__dict__[n]))


def _same_signatures(cls, protocol) -> None:
    for name in _members(protocol):
        want = inspect.signature(getattr(protocol, name))
        got = inspect.signature(getattr(cls, name))
        assert list(got.parameters) == list(want.parameters), (cls.__name__, name, got, want)
        kinds = [p.kind for p in got.parameters.values()]
        assert kinds == [p.kind for p in want.parameters.values()], (cls.__name__, name)


def _fsdp_engine() -> FsdpEngine:
    module = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return FsdpEngine(module, optimizer, scheduler, torch.device("cpu"), 1.0)


def _deepspeed_engine(stage: int) -> DeepSpeedEngine:
    # Only what the adapter reads when it is made: the adapter composes DeepSpeed's engine.
    inner = SimpleNamespace(
        module=torch.nn.Linear(2, 2),
        device=torch.device("cpu"),
        optimizer=SimpleNamespace(param_groups=[{"lr": 0.1}]),
        zero_optimization_stage=lambda: stage,
    )
    return DeepSpeedEngine(inner)


@pytest.mark.parametrize("make", [_fsdp_engine, lambda: _deepspeed_engine(3)], ids=["fsdp", "deepspeed"])
def test_both_engines_are_engines(make):
    engine = make()
    assert isinstance(engine, Engine)
    _same_signatures(type(engine), Engine)
    assert engine.sharded is True


def test_sharded_replaces_the_zero_stage_question():
    assert _deepspeed_engine(3).sharded and not _deepspeed_engine(2).sharded
    assert not _deepspeed_engine(0).sharded


def test_the_fsdp_engine_steps_through_the_protocol():
    """backward with the boundary, then one step that says what the loop records."""
    engine = _fsdp_engine()
    before = engine.module.weight.detach().clone()
    for boundary in (False, True):
        engine.backward(engine(torch.ones(1, 2)).sum(), boundary=boundary)
    result = engine.step()
    assert result.applied and result.grad_norm > 0 and result.lr == pytest.approx(0.1)
    assert not torch.equal(before, engine.module.weight)
    assert all(p.grad is None for p in engine.module.parameters())
    assert set(engine.trainable_state()) == {"weight", "bias"}


@pytest.mark.parametrize("strategy,cls", [("deepspeed", DeepSpeedBackend), ("fsdp", FsdpBackend)])
def test_the_registry_builds_each_strategys_backend(tmp_path, strategy, cls):
    assert set(BACKENDS) == set(DistributedSection.model_fields["strategy"].annotation.__args__)
    recipe = tiny_recipe(
        tmp_path / "cache", tmp_path / "run", distributed={"strategy": strategy, "zero_stage": 3}
    )
    backend = BACKENDS[strategy](recipe, "cpu")
    assert isinstance(backend, cls) and isinstance(backend, Backend)
    _same_signatures(cls, Backend)


# The job, its session, the loop, saving and checkpoints: lorakit's verbs only. (Evaluation's run_eval still
# names its flag `zero3`; the session hands it Engine.sharded.)
PROTOCOL_ONLY = ["loop.py", "job.py", "session.py", "save.py", "checkpoint.py"]
BACKEND_WORDS = ["deepspeed", "zero_stage", "zero-3", "ds_", "fsdp", "hasattr(", "set_gradient_accumulation"]


@pytest.mark.parametrize("name", PROTOCOL_ONLY)
def test_the_job_and_the_loop_speak_only_the_protocol(name):
    text = (ENGINE_DIR / name).read_text().lower()
    assert not [w for w in BACKEND_WORDS if w in text], name


def _strategy_comparisons(path: Path) -> list[int]:
    """Lines of `path` comparing something's `.strategy` or the names "deepspeed" / "fsdp" (ast, so a
    comment or a docstring is no comparison, nor export's own merge `strategy` variable)."""
    import ast

    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "strategy" for s in sides) or any(
                isinstance(s, ast.Constant) and s.value in ("deepspeed", "fsdp") for s in sides
            ):
                lines.append(node.lineno)
    return lines


def test_no_code_outside_the_backends_compares_the_strategy():
    package = ENGINE_DIR.parent
    found = {
        str(p.relative_to(package.parent)): lines
        for p in sorted(package.rglob("*.py"))
        if "backends" not in p.relative_to(package).parts and (lines := _strategy_comparisons(p))
    }
    assert not found, f"ask the backend (lorakit.backends) instead: {found}"
    # The scan sees a comparison where there is one.
    assert _strategy_comparisons(package / "backends" / "__init__.py")


@pytest.mark.parametrize(
    "strategy,stage,kind", [("deepspeed", 3, "partitioned"), ("deepspeed", 2, "whole"), ("fsdp", 3, "whole")]
)
def test_each_backend_plans_the_load(tmp_path, strategy, stage, kind):
    """ZeRO-3 loads partitioned under its config, stages 0-2 whole; FSDP2 in one process whole (several
    processes: on the meta device, tests/integration/test_fsdp.py)."""
    from lorakit.backends import backend_for

    raw = {"strategy": strategy, "zero_stage": stage}
    recipe = tiny_recipe(tmp_path / "cache", tmp_path / "run", distributed=raw)
    config = {"zero_optimization": {"stage": stage}}
    plan = backend_for(recipe, "cpu").load_plan(config)
    assert plan.kind == kind and (plan.zero_config is config) == (kind == "partitioned")


def test_generation_gathers_as_the_setting_says_and_auto_only_what_fits(monkeypatch):
    """distributed.gather_for_generation: true and false as given; auto gathers what fits in GATHER_SHARE of
    the free memory (one process: no other rank to agree with). A rule that gathered whatever the size would
    put a model that only fits sharded out of memory at its first eval."""
    import psutil

    from lorakit.backends.base import GATHER_SHARE, gathers_for_generation

    free = 8 * 2**30
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=free))
    cpu = torch.device("cpu")
    assert gathers_for_generation(True, 10 * free, cpu) and not gathers_for_generation(False, 0, cpu)
    assert gathers_for_generation("auto", int(GATHER_SHARE * free), cpu)
    assert not gathers_for_generation("auto", int(GATHER_SHARE * free) + 1, cpu)


def test_the_recipe_takes_gather_for_generation_as_auto_or_a_boolean():
    assert DistributedSection().gather_for_generation == "auto"
    assert DistributedSection(gather_for_generation=False).gather_for_generation is False
    with pytest.raises(ValueError, match="gather_for_generation"):
        DistributedSection(gather_for_generation="sometimes")
