"""The first step's expert-gradient check (lorakit/model/expert_gradients.py) on FSDP2, in one process (a
one-process gloo group): the tiny Mixtral with LoRA on its fused experts sharded by lorakit's FSDP2 backend,
one step through its engine. FSDP2's sharded parameters get their gradients from its reduce-scatter, not
from autograd, so the probe reads them where FSDP2 puts them; it counts what the unsharded probe counts,
and none is an error. The 2-process count is in tests/integration/test_fsdp.py's Mixtral run; one process
and DeepSpeed in tests/unit/test_moe.py."""

from __future__ import annotations

import pytest
import torch

from lorakit.model import build_model
from lorakit.model.expert_gradients import ExpertGradientProbe, ExpertsNotTrainingError
from tests.conftest import tiny_recipe
from tests.integration.moe_worker import SKEWED
from tests.unit.test_moe import CAUSAL, _recipe


def _fsdp(tmp_path, **train):
    return tiny_recipe(
        tmp_path,
        tmp_path / "run",
        model={"name_or_path": "tiny:mixtral", "attention": "sdpa"},
        data=CAUSAL,
        method={"r": 4, "alpha": 8, "dropout": 0.0},
        distributed={"strategy": "fsdp", "zero_stage": 3},
        train=train,
    )


def _built(recipe, nonzero_b: bool = False):
    """The built model, with non-zero B if asked (as PiSSA and OLoRA start)."""
    built = build_model(recipe)
    if nonzero_b:
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            for n, p in sorted(built.model.named_parameters()):
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return built


def _sharded_engine(recipe, built):
    """`built` wrapped by lorakit's FSDP2 backend (its AdamW, a constant LR)."""
    from lorakit.backends.fsdp import FsdpBackend

    schedule = lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)  # noqa: E731
    return FsdpBackend(recipe, "cpu").wrap(built, {}, schedule)


def _one_step(engine, ids: torch.Tensor) -> None:
    engine.train()
    engine.backward(engine(input_ids=ids, labels=ids).loss, boundary=True)
    assert engine.step().applied


def _expert_lora_b(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if ".experts." in n and "lora_B" in n}


def _outer_expert_wrappers(model):
    """Each layer's outermost peft ParamWrapper of the experts (down_proj's, around gate_up_proj's)."""
    from peft.tuners.lora.layer import ParamWrapper

    return [m for n, m in model.named_modules() if isinstance(m, ParamWrapper) and n.endswith("mlp.experts")]


def test_peft_keeps_expert_e_of_a_stack_in_the_columns_r_times_e_plus_e(tmp_path):
    """The layout the count reads (expert e's lora_B columns r_i * E + e), checked against peft's delta."""
    from peft.tuners.lora.layer import ParamWrapper

    from lorakit.model.expert_gradients import expert_columns

    model = build_model(_recipe(tmp_path)).model
    wrapper = next(m for m in model.modules() if isinstance(m, ParamWrapper))
    b = wrapper.lora_B["default"].weight
    experts = wrapper.num_experts
    with torch.no_grad():
        wrapper.lora_A["default"].weight.fill_(1.0)
        for e in range(experts):
            b.zero_()
            b[:, e::experts] = 1.0  # expert e's columns of every rank
            delta = wrapper.get_delta_weight("default")  # experts x ... per expert
            assert [bool(delta[k].abs().sum() > 0) for k in range(experts)] == [
                k == e for k in range(experts)
            ]
            assert expert_columns(b, experts).tolist() == [k == e for k in range(experts)]
    # A rank whose shard holds no rows (fewer rows than ranks) counts no expert.
    assert expert_columns(torch.zeros(0, b.shape[1]), experts).tolist() == [False] * experts


def test_on_fsdp2_the_first_step_counts_the_experts_that_got_gradients_as_unsharded(tmp_path):
    """One repeated token reaches some experts only: the sharded probe finds the same experts as the
    unsharded one, though weight decay on a non-zero B (as PiSSA and OLoRA start) changed every expert's
    columns (a count of changed adapters would say all); a batch that reaches every expert counts them all."""
    import copy

    from torch.distributed.tensor import DTensor, Shard

    from lorakit.engine.launch import process_group
    from lorakit.model.expert_gradients import expert_columns

    recipe = _fsdp(tmp_path, weight_decay=0.1)
    built = _built(recipe, nonzero_b=True)
    plain = copy.deepcopy(built.model)
    probe = ExpertGradientProbe(plain)
    plain(input_ids=torch.tensor(SKEWED), labels=torch.tensor(SKEWED)).loss.backward()
    want = [s.tolist() for s in probe.seen]
    probe.finish()
    with process_group("gloo"):
        engine = _sharded_engine(recipe, built)
        config = engine.module.config
        for p in _expert_lora_b(engine.module).values():
            # FSDP2 shards dim 0: each rank holds every column (expert) of its rows.
            assert isinstance(p, DTensor) and p.placements == (Shard(0),)
            assert p.to_local().shape[1] == p.shape[1]
        before = {n: p.to_local().clone() for n, p in _expert_lora_b(engine.module).items()}
        probe = ExpertGradientProbe(engine.module)
        _one_step(engine, torch.tensor(SKEWED))
        said: list[str] = []
        got, total = probe.check(said.append)
        assert [s.tolist() for s in probe.seen] == want
        assert total == 2 * config.num_hidden_layers * config.num_local_experts and 0 < got < total
        assert said == [
            f"experts: {got} of {total} expert adapters (4 fused stacks) received gradients in the first step "
            "(an expert no token of the step was routed to gets none)"
        ]
        for n, p in _expert_lora_b(engine.module).items():
            assert expert_columns(p.to_local() - before[n], config.num_local_experts).all()

        probe = ExpertGradientProbe(engine.module)
        ids = torch.randint(4, 1000, (4, 32), generator=torch.Generator().manual_seed(0))
        _one_step(engine, ids)
        assert probe.check(said.append) == (total, total)
        assert said[-1] == (
            f"experts: {total} of {total} expert adapters (4 fused stacks) received gradients in the first step"
        )


def test_on_fsdp2_experts_whose_forward_bypasses_the_lora_are_an_error(tmp_path, monkeypatch):
    """The experts computed from their fused weights without peft's wrapper: no expert adapter gets a
    gradient, which stops the run (exit 2) after its first step."""
    from lorakit.engine.launch import process_group

    recipe = _fsdp(tmp_path)
    ids = torch.randint(4, 1000, (4, 32), generator=torch.Generator().manual_seed(0))
    with process_group("gloo"):
        engine = _sharded_engine(recipe, _built(recipe))
        for wrapper in _outer_expert_wrappers(engine.module):
            inner = wrapper
            while hasattr(inner, "base_layer"):
                inner = inner.base_layer
            monkeypatch.setattr(wrapper, "forward", inner.forward)
        probe = ExpertGradientProbe(engine.module)
        _one_step(engine, ids)
        said: list[str] = []
        with pytest.raises(ExpertsNotTrainingError, match=r"experts: 0 of 16 expert adapters") as err:
            if probe:  # as the run's call site (lorakit/engine/job.py): a probe without stacks checks nothing
                probe.check(said.append)
        assert err.value.exit_code == 2 and said == []
