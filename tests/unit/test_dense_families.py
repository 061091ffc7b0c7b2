"""The dense causal families of issue 45 (Qwen3, Gemma 2, Gemma 3, Phi-3/4, OLMo 2), each on a tiny model
built here: packed rows equal each example alone on every packing backend the family runs on CPU (logits
and loss, through the doctor's contract), the family's kernel table decides the kernel, Gemma 2's capped
scores stay capped on lorakit's per-example loop, the planner reads multimodal Gemma 3 configs, and a merge of
each verifies (fused qkv_proj / gate_up_proj included)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorakit.doctor import contracts
from lorakit.model import fused_attention as fa
from lorakit.model.families import FAMILIES, family_named
from lorakit.model.families.base import LOOP, VARLEN
from tests.conftest import training_config_model

DENSE = ("qwen3", "gemma2", "gemma3", "phi3", "olmo2")
# The CPU packing backends of each (tests/conftest.py PACKING_BACKENDS): transformers runs Gemma 2 on eager
# (or flash) only, SDPA cannot cap its scores.
BACKENDS = {kind: ("varlen_sdpa", "sdpa_mask", "eager") for kind in DENSE} | {"gemma2": ("eager",)}
CASES = [(kind, backend) for kind in DENSE for backend in BACKENDS[kind]]
CUDA = torch.device("cuda")


@pytest.mark.parametrize(("kind", "backend"), CASES, ids=[f"{k}-{b}" for k, b in CASES])
def test_packed_examples_equal_examples_alone(cache_dir, tmp_path, kind, backend):
    """The doctor's packing contract in float32, in the training configuration (gradient checkpointing,
    LoRA with a non-zero update, train mode); the examples are longer than the tiny sliding window (64)."""
    built = training_config_model(cache_dir, tmp_path / "run", backend, name_or_path=f"tiny:{kind}")
    result = contracts.packing(built, packed=True, tolerance=1e-4)
    assert result.passed, result.detail
    assert result.data["examples"] == len(contracts.CAUSAL_LENGTHS)
    if kind in ("gemma2", "gemma3"):
        assert "alternating a 64-token sliding window and full attention" in result.data["kinds"]
    if backend == "varlen_sdpa":
        # Every layer's packed call ran lorakit's per-example loop (CPU), counted in the model's log.
        assert set(built.inputs.kernels.counts()) == {"causal"}


def test_a_family_without_fused_kernels_never_gets_one():
    """choose_kernel takes only what the family's table allows, on a CUDA bf16 call that would otherwise
    take varlen (T5: flex); Gemma 2 (soft-capping) and BART list none, so every kind takes the loop."""
    for family in FAMILIES:
        for kind in fa.KINDS:
            allowed = family.packed.kernels_for(kind)
            bias = kind in ("encoder", "decoder")
            got = fa.choose_kernel(kind, CUDA, torch.bfloat16, 0.0, bias=bias, allowed=allowed)
            assert got in allowed, (family.name, kind, got)
    gemma2 = family_named("gemma2").packed
    assert gemma2.kernels_for("causal") == (LOOP,)
    assert fa.choose_kernel("causal", CUDA, torch.bfloat16, 0.0, bias=False, allowed=(LOOP,)) == LOOP
    why = fa._decide("causal", CUDA, torch.bfloat16, 0.0, False, None, (LOOP,))[1]
    assert "family allows loop" in why and "not varlen" in why
    for name in ("qwen3", "gemma3", "phi3", "olmo2"):
        allowed = family_named(name).packed.kernels_for("causal")
        assert fa.choose_kernel("causal", CUDA, torch.bfloat16, 0.0, bias=False, allowed=allowed) == VARLEN
    # A capped call takes the loop whatever the table says.
    assert fa.choose_kernel("causal", CUDA, torch.bfloat16, 0.0, bias=False, softcap=50.0) == LOOP


@pytest.mark.parametrize("kind", ["gemma2", "llama"])
def test_packed_segments_carry_the_familys_kernel_table(kind):
    from lorakit.data.collate import PackedCausalCollator
    from lorakit.model.inputs import ModelInputs
    from lorakit.model.varlen import VARLEN_SDPA, allowed_kernels
    from lorakit.testing import tiny_config

    rows = [{"input_ids": [5] * n, "labels": [5] * n} for n in (3, 4)]
    kwargs = ModelInputs(tiny_config(kind), VARLEN_SDPA, torch.bfloat16)(
        PackedCausalCollator(16)(rows), "cpu"
    )
    assert allowed_kernels(kwargs["lorakit_segments"], "causal") == family_named(kind).packed.kernels_for(
        "causal"
    )


def test_the_loop_caps_scores_as_gemma2s_eager_attention(cache_dir):
    """lorakit's per-example loop with soft-capping == transformers' eager Gemma 2 attention on each example
    alone (a cap small enough to matter), and != the uncapped loop."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    from lorakit.model.varlen import Segments, varlen_sdpa_attention
    from lorakit.testing import tiny_config

    config = tiny_config("gemma2")
    module = family_named("gemma2").tiny.model(config).model.layers[0].self_attn.eval()
    gen = torch.Generator().manual_seed(0)
    lengths = (30, 90, 7)
    q = torch.randn(1, 4, sum(lengths), 16, generator=gen) * 3
    k, v = (torch.randn(1, 2, sum(lengths), 16, generator=gen) * 3 for _ in range(2))
    bounds = (0, 30, 120, 127)
    kw = {"scaling": 0.25, "sliding_window": 64}
    capped, _ = varlen_sdpa_attention(
        module, q, k, v, None, lorakit_segments=Segments(bounds), softcap=2.0, **kw
    )
    plain, _ = varlen_sdpa_attention(module, q, k, v, None, lorakit_segments=Segments(bounds), **kw)
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        n = e - s
        idx = torch.arange(n)
        allowed = (idx[None, :] <= idx[:, None]) & (idx[None, :] > idx[:, None] - 64)
        mask = torch.zeros(n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
        ref, _ = eager_attention_forward(
            module, q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], mask, scaling=0.25, softcap=2.0
        )
        torch.testing.assert_close(capped[:, s:e], ref, rtol=1e-5, atol=1e-5)
    assert (capped - plain).abs().max() > 0.1


def test_the_planner_reads_multimodal_gemma3_from_its_text_config():
    """`'Gemma3Config' object has no attribute 'vocab_size'` was the crash; its language model's sizes."""
    from lorakit.planner.arch import arch_from_config, known_config

    arch = arch_from_config(known_config("google/gemma-3-12b-it"))
    assert arch.family == "gemma3" and arch.model_type == "gemma3"
    assert (arch.vocab, arch.hidden, arch.ffn, arch.layers, arch.heads, arch.kv_heads, arch.head_dim) == (
        262208, 3840, 15360, 48, 16, 8, 256
    )  # fmt: skip
    assert arch.tied_head and arch.max_length == 131072
    # The whole checkpoint: 12.2B with the vision tower (Gemma 3 12B's published size).
    assert 12.1e9 < arch.total_params < 12.3e9
    qwen3 = arch_from_config(known_config("Qwen/Qwen3-8B"))
    assert (qwen3.family, qwen3.layers, qwen3.head_dim, qwen3.kv_heads, qwen3.tied_head) == (
        "qwen3",
        36,
        128,
        8,
        False,
    )
    assert 8.1e9 < qwen3.total_params < 8.3e9  # Qwen3-8B: 8.2B


def test_the_tiled_loss_is_refused_where_logits_are_capped(tmp_path):
    """Gemma 2 caps its logits after the head (final_logit_softcapping): tiles of head + loss would cap the
    losses. Gemma 3 caps nothing and tiles; a Gemma 3 config that caps is refused as Gemma 2 is."""
    from lorakit.errors import RecipeError
    from lorakit.model.tiled_loss import loss_tile_tokens
    from lorakit.testing import tiny_config
    from tests.unit.test_tiled_mlp import tiny_llama_recipe

    recipe = tiny_llama_recipe(tmp_path, tiled_loss=True)
    assert loss_tile_tokens(recipe, tiny_config("gemma3")) is not None
    capped = tiny_config("gemma3")
    capped.final_logit_softcapping = 30.0
    for config in (tiny_config("gemma2"), capped):
        with pytest.raises(RecipeError, match="model.tiled_loss: true"):
            loss_tile_tokens(recipe, config)
    auto = tiny_llama_recipe(tmp_path, sp=2, tiled_loss="auto")  # auto tiles with sequence parallelism
    assert loss_tile_tokens(auto, tiny_config("gemma3")) is not None
    assert loss_tile_tokens(auto, capped) is None


@pytest.mark.parametrize("kind", DENSE)
def test_a_streamed_merge_of_each_family_verifies(cache_dir, tmp_path, kind):
    """all-linear LoRA on the tiny model (Phi-3's fused qkv_proj and gate_up_proj get one adapter each),
    merged shard by shard, each tensor checked and the whole model's logits compared."""
    import lorakit
    from tests.unit.test_merge_checks import make_adapter

    adapter = make_adapter(cache_dir, tmp_path / "adapter", kind=kind)
    if kind == "phi3":
        import json

        targets = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
        assert {"qkv_proj", "gate_up_proj"} <= {t.rsplit(".", 1)[-1] for t in targets}
    result = lorakit.merge(adapter, tmp_path / "merged", strategy="stream", verify="always", dtype="float32")
    assert result.strategy == "stream" and result.tensors.merged > 0 and result.tensors.worst <= 1
    merged = [c for c in result.checks if c.adapter_effect is not None]
    # The adapter moves the logits far more than the merge is off by (a merge that dropped it would fail).
    assert merged and all(c.passed and c.adapter_effect > 100 * c.max_logit_diff for c in merged)


# --- unknown architectures -------------------------------------------------------------------------------


def _unknown_dirs(tmp_path):
    """A ViT (a config class transformers knows, with no causal LM class) and a model type it does not know,
    each saved with the tiny tokenizer."""
    import json

    from transformers import ViTConfig

    from lorakit.testing import build_tiny_tokenizer

    vit, foo = tmp_path / "vit", tmp_path / "foo"
    ViTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    ).save_pretrained(vit)
    foo.mkdir()
    (foo / "config.json").write_text(json.dumps({"model_type": "foo_lm", "hidden_size": 32}))
    for path in (vit, foo):
        build_tiny_tokenizer(path, "llama")
    return vit, foo


def test_an_unknown_architecture_is_a_recipe_error_naming_the_config_class_and_the_way_forward(tmp_path):
    from lorakit.errors import RecipeError
    from lorakit.model import build_model
    from lorakit.model.families.unknown import loadable_class
    from lorakit.planner import plan
    from lorakit.planner.units import PlanError
    from tests.conftest import tiny_recipe

    vit, foo = _unknown_dirs(tmp_path)
    recipe = tiny_recipe(
        tmp_path, tmp_path / "run", model={"name_or_path": str(vit)}, data={"format": "instruction"}
    )
    for call, error in (
        (lambda: build_model(recipe), RecipeError),
        (lambda: plan(recipe, gpu_memory="80GB"), PlanError),
    ):
        with pytest.raises(error) as caught:
            call()
        text = str(caught.value)
        assert "ViTConfig (model type 'vit')" in text and "AutoModelForCausalLM" in text
        assert "model.trust_remote_code: true" in text and "generic path" in text
        assert caught.value.exit_code == 2
    foo_recipe = recipe.model_copy(
        update={"model": recipe.model.model_copy(update={"name_or_path": str(foo)})}
    )
    for call, error in (
        (lambda: build_model(foo_recipe), RecipeError),
        (lambda: plan(foo_recipe, gpu_memory="80GB"), PlanError),
    ):
        with pytest.raises(error, match=r"model type 'foo_lm'\) is an architecture no lorakit model family"):
            call()
    # A checkpoint that names its own code: the message says it does, and trust_remote_code lets it load.
    from transformers import ViTConfig

    config = ViTConfig(auto_map={"AutoModelForCausalLM": "modeling_vit_lm.ViTForCausalLM"})
    with pytest.raises(RecipeError, match="its checkpoint ships its own modeling code"):
        loadable_class(config)
    assert loadable_class(config, trust_remote_code=True)[1] is None


@pytest.mark.slow
def test_the_plan_cli_exits_2_on_an_unknown_architecture_without_a_traceback(tmp_path):
    import os
    import subprocess
    import sys

    vit, _ = _unknown_dirs(tmp_path)
    cmd = [
        sys.executable,
        "-m",
        "lorakit.plan",
        "recipes/quickstart_causal.yaml",
        f"model.name_or_path={vit}",
        "--gpu-memory",
        "80GB",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=root)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "ViTConfig (model type 'vit')" in proc.stderr + proc.stdout


# --- the recipes' plans in docs/models.md ---------------------------------------------------------------

# What docs/models.md's covered-by block runs: "lorakit.plan" on each recipe with --gpu-memory.
PLANNED = {
    "qwen3_8b_lora.yaml": "80GB",
    "qwen3_8b_lora_1gpu.yaml": "80GB",
    "gemma3_12b_lora.yaml": "80GB",
    "llama3_8b_qlora_24gb.yaml": "24GB",
}


def test_the_recipe_plans_are_the_ones_documented():
    """Each recipe of docs/models.md fits its hardware, and the table's trainable count, per-GPU memory and
    longest row are what the planner gives now (offline, from the built-in configs)."""
    import re

    import lorakit

    root = Path(__file__).resolve().parents[2]
    doc = (root / "docs" / "models.md").read_text(encoding="utf-8")
    for name, gpu_memory in PLANNED.items():
        assert f"python -m lorakit.plan recipes/{name} --gpu-memory {gpu_memory}" in doc
        p = lorakit.plan(root / "recipes" / name, gpu_memory=gpu_memory)
        assert p.fits, name
        row = re.search(rf"^\| `{re.escape(name)}` \|.*$", doc, re.MULTILINE)
        assert row, f"docs/models.md has no row for {name}"
        cells = [c.strip() for c in row[0].strip("|").split("|")]
        assert cells[3] == f"{p.trainable_params:,}", name
        assert cells[4] == f"{p.per_gpu_bytes / 2**30:.2f} GiB", name
        assert cells[5] == f"{p.longest_row:,}", name


def test_the_doctors_block_of_a_multimodal_gemma3_is_one_language_model_block():
    """The doctor times one block of the recipe's model: of Gemma-3-12B's language model, not the whole
    48-layer checkpoint its top-level config would have built."""
    from lorakit.doctor.models import block_config
    from lorakit.planner.arch import known_config

    raw, scale = block_config(known_config("google/gemma-3-12b-it"), max_width=256)
    assert raw["model_type"] == "gemma3_text" and raw["num_hidden_layers"] == 1 and scale < 1
    assert raw["layer_types"] == ["sliding_attention"]


def test_a_multimodal_gemma3_adapter_merges_in_memory_and_verifies(tmp_path):
    """Gemma3ForConditionalGeneration (the 4B-27B checkpoints) at tiny size: its config has no vocab_size
    (the merge's probe read it there and raised an AttributeError); transformers saves its weights under
    other names than the model's, which the streaming merge reads through transformers' conversion mapping:
    `auto` streams (it fell back to the in-memory merge before), and the export verifies."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Gemma3Config, Gemma3ForConditionalGeneration

    import lorakit
    from lorakit.model.families.gemma import _TINY
    from lorakit.testing import TINY_VOCAB_SIZE, build_tiny_tokenizer

    text = {k: v for k, v in _TINY.items() if k != "tie_word_embeddings"}
    text |= dict(model_type="gemma3_text", vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, bos_token_id=3,
                 eos_token_id=1, pad_token_id=0)  # fmt: skip
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=1999, boi_token_index=1998, eoi_token_index=1997)  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(0)
        Gemma3ForConditionalGeneration(config).save_pretrained(tmp_path / "base")
        build_tiny_tokenizer(tmp_path / "base", "llama")
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
        peft_model = get_peft_model(model, lora)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
    peft_model.save_pretrained(tmp_path / "adapter")
    result = lorakit.merge(tmp_path / "adapter", tmp_path / "merged", dtype="float32")
    assert result.strategy == "stream" and result.checks and all(c.passed for c in result.checks)
