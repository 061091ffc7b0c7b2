"""Mixture-of-experts families (Mixtral, Qwen3-MoE, OLMoE): LoRA on the fused experts with the router frozen
unless asked, the load-balancing loss (as transformers defines it, token-weighted, its router gradient the
formula's), the planner's expert counts, packing, ZeRO-3 leaves and dropout (on the linear
layers' adapters only)."""

from __future__ import annotations

import pytest
import torch

from lorakit.errors import RecipeError
from lorakit.model.families import family_named
from lorakit.model.router import load_balancing_loss
from lorakit.testing import SPECIAL_TOKENS, TINY_VOCAB_SIZE
from tests.conftest import tiny_recipe

MOE_KINDS = ("mixtral", "qwen3_moe", "olmoe")
CAUSAL = {"format": "instruction", "max_length": 128}


def _recipe(tmp_path, kind="mixtral", **method):
    return tiny_recipe(
        tmp_path,
        tmp_path / "run",
        model={"name_or_path": f"tiny:{kind}", "attention": "sdpa"},
        data=CAUSAL,
        method={"r": 4, "alpha": 8, "dropout": 0.0, **method},
    )


def _tiny(kind: str, **overrides):
    family = family_named(kind)
    config = family.tiny.config(TINY_VOCAB_SIZE, bos=SPECIAL_TOKENS.index("<s>"))
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return config, family.tiny.model(config)


def _hand_gradient(logits: list[torch.Tensor], mask: torch.Tensor, experts: int, top_k: int):
    """d aux / d z of every layer by the formula: N m_t / R * p_j (f_j - sum_i f_i p_i), R = layers x real
    tokens, f_i the share of top-k assignments to expert i (lorakit.model.router's docstring)."""
    rows = len(logits) * mask.sum()
    counts = torch.zeros(experts)
    for z in logits:
        chosen = torch.topk(torch.softmax(z, -1), top_k, -1).indices
        for t in range(z.shape[0]):
            counts[chosen[t]] += mask[t]
    f = counts / rows
    out = []
    for z in logits:
        p = torch.softmax(z, -1)
        out.append(experts * mask[:, None] / rows * p * (f[None] - (p * f[None]).sum(-1, keepdim=True)))
    return out


# Each family's modeling module, for transformers' own load_balancing_loss_func of that family.
MODELING = {
    "mixtral": "transformers.models.mixtral.modeling_mixtral",
    "qwen3_moe": "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "olmoe": "transformers.models.olmoe.modeling_olmoe",
}


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_the_load_balancing_loss_is_transformers_and_its_gradient_the_formula(kind):
    import importlib

    load_balancing_loss_func = importlib.import_module(MODELING[kind]).load_balancing_loss_func

    torch.manual_seed(0)
    experts, top_k, tokens = 6, 2, 10
    logits = [torch.randn(tokens, experts, requires_grad=True) for _ in range(3)]
    mask = torch.ones(2, tokens // 2)
    mask[1, 3:] = 0  # padding: excluded from counts and probabilities
    aux = load_balancing_loss(logits, experts, top_k, mask)
    want = load_balancing_loss_func(tuple(logits), experts, top_k, mask)
    torch.testing.assert_close(aux, want)
    aux.backward()
    for z, g in zip(logits, _hand_gradient([z.detach() for z in logits], mask.reshape(-1), experts, top_k),
                    strict=True):  # fmt: skip
        torch.testing.assert_close(z.grad, g)
        assert not z.grad[mask.reshape(-1) == 0].any()


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_sft_adds_the_aux_loss_weighted_by_target_tokens_and_it_moves_the_router_as_the_formula_says(kind):
    """Against each family's own `aux_loss` (transformers computes it in the model's forward)."""
    from lorakit.model.inputs import ModelInputs
    from lorakit.model.loss import token_loss_sum
    from lorakit.objectives.sft import SftObjective

    config, model = _tiny(kind, router_aux_loss_coef=0.5)
    model.train()
    objective = SftObjective.from_recipe(None, config)
    top_k = config.num_experts_per_tok
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    assert objective.router.coef == 0.5 and objective.router.top_k == top_k
    ids = torch.randint(4, TINY_VOCAB_SIZE, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels,
             "num_target_tokens": int((labels != -100).sum())}  # fmt: skip
    inputs = ModelInputs(config, "sdpa", torch.float32)
    last = model.model.layers[-1].mlp.gate
    seen = {}
    handle = last.register_forward_hook(lambda m, a, out: seen.update(h=a[0].detach(), z=out[0].detach()))
    loss_sum, metrics = objective.loss(model, inputs, batch, "cpu")
    handle.remove()
    loss_sum.backward()
    with_aux = last.weight.grad.clone()

    # transformers' own aux loss of this padded batch; the token loss is untouched.
    out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    units = batch["num_target_tokens"]
    torch.testing.assert_close(metrics["aux_loss"] / units, out.aux_loss.detach())
    ce = token_loss_sum(out.logits, labels)
    torch.testing.assert_close(loss_sum, ce + 0.5 * out.aux_loss * units)

    # The router's gradient: the aux loss adds coef x units x (d aux / d z)^T h on the last layer's router
    # (nothing after it reads its weight), d aux / d z by the formula.
    model.zero_grad()
    SftObjective().loss(model, inputs, batch, "cpu")[0].backward()
    every_layer = [z.detach() for z in out.router_logits]
    torch.testing.assert_close(every_layer[-1], seen["z"])
    dz = _hand_gradient(every_layer, mask.reshape(-1).float(), experts, top_k)[-1]
    torch.testing.assert_close(with_aux - last.weight.grad, 0.5 * units * dz.T @ seen["h"], rtol=1e-4,
                               atol=1e-7)  # fmt: skip


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_lora_reaches_the_experts_the_router_stays_frozen_and_the_planner_counts_the_run(tmp_path, kind):
    from lorakit.model import build_model, count_parameters
    from lorakit.model.families.moe import describe
    from lorakit.planner import plan

    recipe = _recipe(tmp_path, kind)
    built = build_model(recipe)
    trainable = {n for n, p in built.model.named_parameters() if p.requires_grad}
    assert any(".mlp.experts.lora_A" in n for n in trainable)  # down_proj
    assert any(".mlp.experts.base_layer.lora_A" in n for n in trainable)  # gate_up_proj
    assert not any(".mlp.gate." in n for n in trainable)
    assert any("self_attn.q_proj.lora_A" in n for n in trainable)
    planned = plan(recipe, gpus=1, gpu_memory="16GB", device="cpu")
    assert planned.trainable_params == count_parameters(built.model)[0]
    line = describe(family_named(kind), recipe.method, built.model.config)
    assert "LoRA on the fused experts (gate_up_proj, down_proj, no dropout)" in line
    assert "the router frozen" in line and "load-balancing loss" in line


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_train_router_adapts_the_router_its_adapter_moves_and_the_planner_counts_it(tmp_path, kind):
    from lorakit.model import build_model, count_parameters
    from lorakit.model.inputs import ModelInputs
    from lorakit.objectives.sft import SftObjective
    from lorakit.planner import plan

    recipe = _recipe(tmp_path, kind, train_router=True, target_modules=["q_proj", "experts"])
    built = build_model(recipe)
    trainable = {n: p for n, p in built.model.named_parameters() if p.requires_grad}
    router = {n: p.detach().clone() for n, p in trainable.items() if ".mlp.gate.lora_" in n}
    assert any(".mlp.gate.lora_A" in n for n in router) and any(".mlp.experts." in n for n in trainable)
    assert not any("k_proj" in n for n in trainable)
    planned = plan(recipe, gpus=1, gpu_memory="16GB", device="cpu")
    assert planned.trainable_params == count_parameters(built.model)[0]

    # Two SGD steps of the SFT objective (token loss and load-balancing loss): every router adapter weight
    # moves (lora_B starts at zero, so lora_A moves from the second step on).
    optimizer = torch.optim.SGD(trainable.values(), lr=0.1)
    objective = SftObjective.from_recipe(recipe, built.model.config)
    inputs = ModelInputs(built.model.config, "sdpa", torch.float32)
    ids = torch.randint(4, TINY_VOCAB_SIZE, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids, "num_target_tokens": 24}
    built.model.train()
    for _ in range(2):
        optimizer.zero_grad()
        objective.loss(built.model, inputs, batch, "cpu")[0].backward()
        optimizer.step()
    after = dict(built.model.named_parameters())
    for name, before in router.items():
        assert not torch.equal(after[name].detach(), before), name


def test_mixtral_8x7b_is_planned_with_its_expert_adapters(tmp_path):
    from lorakit.planner import plan

    recipe = tiny_recipe(
        tmp_path,
        tmp_path / "run",
        model={"name_or_path": "mistralai/Mixtral-8x7B-v0.1", "dtype": "bfloat16"},
        data=CAUSAL,
        method={"kind": "qlora", "r": 16, "dropout": 0.0},
    )
    result = plan(recipe, gpus=8, gpu_memory="80GB")
    # Per layer: q, k, v, o (13.6M over 32 layers) and r x 8 experts x (in + out) on the fused
    # gate_up_proj (4096 -> 2 x 14336) and down_proj (14336 -> 4096).
    attention = 32 * 16 * ((4096 + 4096) * 2 + (4096 + 1024) * 2)
    experts = 32 * 16 * 8 * ((4096 + 2 * 14336) + (14336 + 4096))
    assert attention == 13_631_488
    assert result.trainable_params == attention + experts


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_dropout_applies_to_every_adapted_linear_and_not_to_the_fused_experts(tmp_path, kind):
    """method.dropout 0.05 (every shipped recipe): the linear layers' adapters drop, the fused experts'
    (peft's parameter LoRA, which cannot) do not; the run's one MoE line says so, and the planner plans it."""
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    from lorakit.model import build_model
    from lorakit.model.families.moe import describe
    from lorakit.planner import plan

    recipe = _recipe(tmp_path, kind, dropout=0.05)
    built = build_model(recipe)
    layers = [(n, m) for n, m in built.model.named_modules() if isinstance(m, LoraLayer)]
    fused = [m for _, m in layers if isinstance(m, ParamWrapper)]
    linear = [(n, m) for n, m in layers if not isinstance(m, ParamWrapper)]
    assert fused and linear
    for name, m in linear:
        drop = m.lora_dropout["default"]
        assert isinstance(drop, torch.nn.Dropout) and drop.p == 0.05, name
    assert all(isinstance(m.lora_dropout["default"], torch.nn.Identity) for m in fused)
    # A training forward draws the linear adapters' dropout: two forwards differ, eval ones agree.
    with torch.no_grad():
        for m in linear:
            torch.nn.init.normal_(m[1].lora_B["default"].weight)
    ids = torch.randint(4, TINY_VOCAB_SIZE, (1, 8))
    built.model.train()
    a, b = (built.model(input_ids=ids).logits for _ in range(2))
    assert not torch.equal(a, b)
    built.model.eval()
    torch.testing.assert_close(built.model(input_ids=ids).logits, built.model(input_ids=ids).logits)
    line = describe(family_named(kind), recipe.method, built.model.config)
    assert "LoRA dropout 0.05 on the linear layers' adapters, none on the fused experts" in line
    planned = plan(recipe, gpus=1, gpu_memory="16GB", device="cpu")
    assert "none on the fused experts" in planned.describe()


def test_dora_on_fused_experts_and_a_router_without_moe_are_exit_2_before_loading(tmp_path):
    from lorakit.model import build_model

    with pytest.raises(RecipeError, match=r"method.use_dora.*no DoRA") as err:
        build_model(_recipe(tmp_path, use_dora=True))
    assert err.value.exit_code == 2
    with pytest.raises(RecipeError, match="no MoE router"):
        build_model(tiny_recipe(tmp_path, tmp_path / "run", method={"dropout": 0.0, "train_router": True}))


def test_the_moe_block_is_a_zero3_leaf(tmp_path):
    from deepspeed.utils import z3_leaf_module

    from lorakit.model.build import _set_zero3_leaves

    for kind in MOE_KINDS:
        family = family_named(kind)
        config, model = _tiny(kind)
        _set_zero3_leaves(family, model)
        marked = [type(m).__name__ for m in model.modules() if z3_leaf_module(m)]
        assert marked == list(family.zero3_leaf_modules) * config.num_hidden_layers


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_packed_rows_equal_each_example_alone(kind):
    """Routing and experts are token-wise: a packed row of two examples gives each example's logits."""
    from lorakit.model.inputs import ModelInputs
    from lorakit.model.varlen import register_varlen_sdpa

    config, _ = _tiny(kind)
    config._attn_implementation = register_varlen_sdpa()
    torch.manual_seed(0)
    model = family_named(kind).tiny.model(config).eval()
    inputs = ModelInputs(config, config._attn_implementation, torch.float32)
    a, b = torch.randint(4, TINY_VOCAB_SIZE, (1, 11)), torch.randint(4, TINY_VOCAB_SIZE, (1, 7))
    packed = {"input_ids": torch.cat([a, b], 1), "position_ids": torch.cat([torch.arange(11),
              torch.arange(7)])[None]}  # fmt: skip
    with torch.no_grad():
        got = inputs.logits(model, packed, "cpu")
        alone = [model(input_ids=x).logits for x in (a, b)]
    torch.testing.assert_close(got, torch.cat(alone, 1), rtol=1e-4, atol=1e-5)


def test_a_row_of_one_repeated_token_is_routed_to_two_experts_only():
    """The skewed row of the 2-process ZeRO-3 test (tests/integration/moe_worker.py): every position of it
    reaches the same two experts in every layer, so the other experts see none of that rank's tokens."""
    from lorakit.model.router import capture_router_logits
    from tests.integration.moe_worker import SKEWED

    config, model = _tiny("mixtral")
    with torch.no_grad(), capture_router_logits(model, ("MixtralTopKRouter",)) as logits:
        model(input_ids=torch.tensor(SKEWED))
    assert len(logits) == config.num_hidden_layers
    for z in logits:
        chosen = {tuple(sorted(t)) for t in torch.topk(z, 2, -1).indices.tolist()}
        assert len(chosen) == 1


def test_an_error_with_a_doc_link_is_written_whole_with_its_newline(monkeypatch):
    """Each rank prints a recipe error; written in pieces, one rank's `see docs/recipes.md#method` was
    followed on the same line by another rank's `error: ...`."""
    import sys

    from lorakit.cli import run_cli

    writes: list[str] = []

    class Recorder:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Recorder())

    def body():
        raise RecipeError("method.use_dora: no DoRA here")

    assert run_cli(body) == 2
    assert writes == ["error: method.use_dora: no DoRA here\nsee docs/recipes.md#method\n"]


def test_the_first_step_counts_the_expert_adapters_that_got_gradients_and_none_is_an_error(tmp_path):
    from lorakit.model import build_model
    from lorakit.model.expert_gradients import ExpertGradientProbe, ExpertsNotTrainingError

    built = build_model(_recipe(tmp_path))
    config = built.model.config
    ids = torch.randint(4, TINY_VOCAB_SIZE, (2, 12))
    probe = ExpertGradientProbe(built.model)
    assert len(probe.stacks) == 2 * config.num_hidden_layers  # gate_up_proj and down_proj per layer
    built.model(input_ids=ids, labels=ids).loss.backward()
    said: list[str] = []
    got, total = probe.check(said.append)
    assert total == 2 * config.num_hidden_layers * config.num_local_experts
    assert 0 < got <= total and said and f"{got:,} of {total:,} expert adapters" in said[0]
    # Experts that no token reached get no gradient: the count is per expert, not per stack.
    built.model.zero_grad()
    probe = ExpertGradientProbe(built.model)
    built.model(input_ids=torch.full((1, 4), 7), labels=torch.full((1, 4), 7)).loss.backward()
    assert probe.finish()[0] < total

    # The experts' LoRA out of the computation (here: the adapters disabled for the forward): exit 2.
    built.model.zero_grad()
    probe = ExpertGradientProbe(built.model)
    with built.model.disable_adapter():
        out = built.model(input_ids=ids, labels=ids)
    (
        out.loss + sum(p.sum() * 0 for n, p in built.model.named_parameters() if "q_proj.lora_B" in n)
    ).backward()
    with pytest.raises(ExpertsNotTrainingError, match="0 of .* expert adapters") as err:
        probe.check(said.append)
    assert err.value.exit_code == 2


def test_a_qlora_moe_plan_fits_one_24gb_gpu_and_says_which_weights_are_4_bit(tmp_path):
    """QLoRA quantizes Qwen3-30B-A3B's fused experts too (lorakit.model.quant_experts): the recipe fits one
    24 GB GPU at its sequence length (public reference: ~17.5 GB, Unsloth), and the plan's line for the frozen
    base says which weights are 4-bit and which are not; never advising QLoRA to a QLoRA recipe."""
    from lorakit.planner import plan
    from lorakit.recipe import load_recipe

    recipe = load_recipe("recipes/qwen3_30b_a3b_qlora.yaml")
    planned = plan(recipe, gpus=1, gpu_memory="24GB")
    text = planned.describe()
    frozen = next(line for line in text.splitlines() if "frozen base weights" in line)
    assert "4-bit: 28.99B fused expert and 0.91B linear weights; 16-bit: 0.64B" in frozen
    assert "the recipe as written fits" in text and "DOES NOT FIT" not in text
    per_gpu = float(next(line for line in text.splitlines() if "= per GPU" in line).split()[3])
    assert 15 < per_gpu < 22.35  # GiB: more than the 4-bit base, within one 24 GB GPU
    assert recipe.data.max_length == recipe.train.max_tokens == 4096
    # FSDP2's byte model counts the 4-bit experts too (its units hold packed weights).
    fsdp = plan(load_recipe("recipes/qwen3_30b_a3b_qlora.yaml", ["distributed.strategy=fsdp",
                "distributed.offload_optimizer=none", "distributed.zero_stage=3"]), gpus=1, gpu_memory="24GB")  # fmt: skip
    frozen_fsdp = next(i.bytes for i in fsdp.estimate.items if i.name == "frozen base weights")
    assert 15 * 2**30 < frozen_fsdp < 16 * 2**30
    # The same recipe with the experts left in bf16 would not: the 4-bit experts are what make it fit.
    lora = plan(load_recipe("recipes/qwen3_30b_a3b_qlora.yaml", ["method.kind=lora", "method.quant_type=null"]),
                gpus=1, gpu_memory="24GB").describe()  # fmt: skip
    assert "the recipe as written DOES NOT FIT" in lora
