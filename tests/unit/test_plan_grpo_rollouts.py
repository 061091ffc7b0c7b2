"""lorakit.plan counts GRPO's rollouts (lorakit.planner.rollouts): the KV cache of G completions per prompt
(encoder-decoders: the decoder's, the cross-attention's and the encoder output), generate's logits, the
no-grad forwards, and how a step's time splits between generating and training."""

from __future__ import annotations

import pytest

from lorakit.errors import RecipeError
from lorakit.objectives import Objective, objective_named, register, unregister
from lorakit.objectives.grpo_settings import GRPO, GrpoSection
from lorakit.planner import plan
from lorakit.planner.arch import arch_from_config, known_config
from lorakit.planner.rollouts import LINK_BYTES_PER_S, LOGITS_COPIES, rollout_plan
from lorakit.recipe import load_recipe
from tests.conftest import RECIPES

LENGTH = {"name": "length", "target": 8}


class _Grpo(Objective):
    """train.objective grpo as a plugin registers it, for a tree where the built-in is not registered yet:
    the planner asks an objective only for its passes (the default's here)."""

    spec = GRPO

    def units(self, batch):
        raise NotImplementedError("the planner does not train")

    def loss(self, *args, **kwargs):
        raise NotImplementedError("the planner does not train")


@pytest.fixture
def grpo_registered():
    try:
        objective_named("grpo")
        yield
    except RecipeError:
        register(_Grpo, GrpoSection)
        try:
            yield
        finally:
            unregister("grpo")


def _grpo(recipe, **section):
    settings = GrpoSection(rewards=[LENGTH], **section)
    train = recipe.train.model_copy(update={"objective": "grpo"})
    return recipe.model_copy(update={"train": train, "grpo": settings})


def _arch(name):
    return arch_from_config(known_config(name))


def _kw(**over):
    kw = dict(micro_batch_size=2, num_generations=8, prompt_len=256, max_new_tokens=512, beta=0.0,
              passes=1, dtype_bytes=2, weight_bytes=16 * 2**30, adapter=True, gradient_checkpointing=False)  # fmt: skip
    return kw | over


def test_the_kv_cache_and_logits_of_g_completions_per_prompt():
    arch = _arch("meta-llama/Meta-Llama-3-8B")
    r = rollout_plan(arch, **_kw())
    # 16 sequences x 32 layers x (keys, values) x 8 KV heads x 128 x 2 bytes x (256 + 512) tokens.
    assert r.sequences == 16
    assert r.kv_cache == 16 * 32 * 2 * 8 * 128 * 2 * 768
    assert r.logits == LOGITS_COPIES * 16 * 128256 * 4 and r.encoder_output == 0
    assert r.generation_bytes == r.kv_cache + r.logits
    assert rollout_plan(arch, **_kw(num_generations=16)).kv_cache == 2 * r.kv_cache
    t5 = _arch("google/flan-t5-xl")
    s = rollout_plan(t5, **_kw())
    # The decoder's own keys and values over the completion, the cross-attention's over the prompt.
    assert s.kv_cache == 16 * 24 * 2 * (32 * 64) * 2 * (512 + 256)
    assert s.encoder_output == 16 * 256 * 2048 * 2


def test_the_time_split_follows_the_settings():
    arch = _arch("meta-llama/Meta-Llama-3-8B")
    base = rollout_plan(arch, **_kw())
    # One pass: the old policy is the current one, no forward for it (as the rollout source skips it).
    assert 0 < base.generate_share < 1 and base.no_grad_forwards == 0
    longer = rollout_plan(arch, **_kw(max_new_tokens=2048))
    assert longer.generate_seconds > 3 * base.generate_seconds
    # Every decoding step gathers the sharded weights; the reference is another no-grad forward.
    assert rollout_plan(arch, **_kw(), gathered_over=8).generate_seconds > 2 * base.generate_seconds
    kl = rollout_plan(arch, **_kw(beta=0.04))
    assert kl.no_grad == ("reference",) and kl.train_seconds > base.train_seconds
    assert kl.generate_seconds == base.generate_seconds
    two = rollout_plan(arch, **_kw(passes=2))
    assert two.train_seconds > base.train_seconds and two.generate_share < base.generate_share
    assert two.no_grad == ("old log-probabilities",)
    assert rollout_plan(arch, **_kw(passes=2, beta=0.04)).no_grad_forwards == 2


def test_the_plan_holds_the_rollouts_memory_and_says_the_split(grpo_registered):
    recipe = load_recipe(RECIPES / "qwen3_8b_grpo_math.yaml")
    small = plan(_grpo(recipe, num_generations=2, max_new_tokens=16), gpu_memory="80GB")
    big = plan(_grpo(recipe, num_generations=64, max_new_tokens=4096), gpu_memory="80GB")
    r = big.estimate.rollouts
    assert r is not None and r.sequences == 64 * recipe.train.micro_batch_size
    # Generating is one of the peak's moments: a forward's weights with the KV cache and logits.
    forward = sum(
        i.bytes for i in big.estimate.items if i.where == "gpu" and i.when in ("resident", "forward")
    )
    assert big.estimate.gpu_allocated >= forward + r.generation_bytes
    assert big.per_gpu_bytes > small.per_gpu_bytes
    assert big.to_dict()["recipe"]["rollouts"]["kv_cache_bytes"] == r.kv_cache
    text = big.describe()
    assert "train.objective grpo: " in text and "of a step generating" in text
    sft = plan(load_recipe(RECIPES / "llama3_8b_lora.yaml"), gpu_memory="80GB")
    assert sft.estimate.rollouts is None and sft.to_dict()["recipe"]["rollouts"] is None


def test_the_planned_micro_batch_is_the_rollouts_completions(grpo_registered):
    """What the loss trains on: micro_batch_size x G rows of prompt + max_new_tokens tokens, padded (GRPO
    never packs), at the recipe's micro-batch size and at every micro-batch size the planner tries."""
    recipe = load_recipe(RECIPES / "qwen3_8b_grpo_math.yaml")
    s, mbs = recipe.grpo, recipe.train.micro_batch_size
    p = plan(recipe, gpu_memory="80GB")
    rows, length = mbs * s.num_generations, recipe.data.max_length + s.max_new_tokens
    shape = p.estimate.shape
    assert (shape.rows, shape.seq_len, shape.example_len) == (rows, length, None)
    assert f"micro-batch of {rows} x {length} tokens" in p.describe()
    assert p.estimate.rollouts.prompt_len == recipe.data.max_length
    # data.packing auto (or true, as the SFT recipe this copies has it) still plans the padded rollouts.
    sft = load_recipe(RECIPES / "llama3_8b_lora.yaml")
    packed = plan(_grpo(sft, num_generations=4, max_new_tokens=64), gpu_memory="40GB")
    e = packed.estimate
    assert (e.shape.rows, e.shape.seq_len) == (4 * sft.train.micro_batch_size, sft.data.max_length + 64)
    assert not e.setup.max_tokens and "packed rows" not in packed.describe()
    tried = packed.recommendation
    assert tried is not None and tried.shape.rows == 4 * tried.setup.micro_batch_size
    # An encoder-decoder: the prompt to the encoder, the completion to the decoder.
    t5 = load_recipe(RECIPES / "flan_t5_xl_lora.yaml")
    e = plan(_grpo(t5, num_generations=4, max_new_tokens=32), gpu_memory="80GB", seq_len=300).estimate
    assert (e.shape.rows, e.shape.seq_len, e.shape.target_len) == (4 * t5.train.micro_batch_size, 300, 32)
    assert e.rollouts.prompt_len == 300


def test_qlora_decoding_reads_the_4bit_base_the_states_count(grpo_registered):
    # Layer by layer, every decoding step gathers and reads the weights: a 4-bit base (~0.5 byte a weight)
    # is gathered and read ~3-4x faster.
    off = "distributed.gather_for_generation=false"
    lora = plan(load_recipe(RECIPES / "qwen3_8b_grpo_math.yaml", [off]), gpu_memory="80GB").estimate.rollouts
    qlora = plan(
        load_recipe(RECIPES / "qwen3_8b_grpo_math.yaml", ["method.kind=qlora", off]), gpu_memory="80GB"
    )
    assert 2.5 < lora.generate_seconds / qlora.estimate.rollouts.generate_seconds < 4.5


def test_weights_gathered_whole_come_over_the_link_once_per_generate_call(grpo_registered):
    arch = _arch("meta-llama/Meta-Llama-3-8B")
    alone = rollout_plan(arch, **_kw())
    per_step = rollout_plan(arch, **_kw(), gathered_over=8)
    per_call = rollout_plan(arch, **_kw(), gathered_over=8, gathered_whole=True)
    # The other 7 ranks' shares of the 16 GiB of weights: at each of the 512 decoding steps, or once.
    link = 16 * 2**30 * 7 / 8 / LINK_BYTES_PER_S
    assert per_step.generate_seconds == pytest.approx(alone.generate_seconds + 512 * link)
    assert per_call.generate_seconds == pytest.approx(alone.generate_seconds + link)
    assert (alone.gathers, per_step.gathers, per_call.gathers) == ("none", "per_step", "per_call")
    assert per_call.train_seconds == per_step.train_seconds
    # The plan: distributed.gather_for_generation decides both the time and the generation's peak.
    on, off = (
        plan(load_recipe(RECIPES / "qwen3_8b_grpo_math.yaml", [f"distributed.gather_for_generation={s}"]),
             gpu_memory="80GB").estimate
        for s in ("true", "false")
    )  # fmt: skip
    assert on.rollouts.gathers == "per_call" and off.rollouts.gathers == "per_step"
    assert on.rollouts.generate_seconds < off.rollouts.generate_seconds / 2
    assert "once per generate call" in on.rollouts.note()
    forward = sum(i.bytes for i in on.items if i.where == "gpu" and i.when == "forward")
    g = on.generation
    assert g.moments == ("GRPO rollouts",) and g.mode == "gathered"
    assert g.peak_bytes - off.generation.peak_bytes == g.whole_bytes - forward
    assert (
        off.generation.peak_bytes
        == sum(i.bytes for i in off.items if i.where == "gpu" and i.when in ("resident", "forward"))
        + off.rollouts.generation_bytes
    )
