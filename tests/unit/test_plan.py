"""The memory planner's parts: sizes, the parameter census, model states, the search and the plan object."""

import json
from types import SimpleNamespace

import pytest
import torch

import lorakit
from lorakit.model.loss import CHUNK_ELEMENTS
from lorakit.planner import PlanError, format_bytes, parse_bytes, plan
from lorakit.planner.arch import KNOWN_CONFIGS, arch_from_config, known_config
from lorakit.planner.search import slowdown
from lorakit.planner.states import Setup
from lorakit.recipe import load_recipe
from tests.conftest import RECIPES, tiny_recipe


def test_sizes_parse_decimal_and_binary_units():
    assert parse_bytes("40GB", "x") == 40 * 10**9
    assert parse_bytes("80GiB", "x") == 80 * 2**30
    assert parse_bytes("1.5 TB", "x") == 1_500_000_000_000
    assert parse_bytes(1024, "x") == 1024
    assert parse_bytes(None, "x") is None
    for bad in ("forty", "40XB", "-1GB", 0, True):
        with pytest.raises(PlanError, match="gpu_memory"):
            parse_bytes(bad, "gpu_memory")
    assert format_bytes(3 * 2**30) == "3.00 GiB" and format_bytes(512) == "512 B"


@pytest.mark.parametrize(
    "name, params, largest",
    [
        # FLAN-T5-XXL: 11135M parameters and a 131M largest layer, as DeepSpeed's estimator printed them in
        # the published FLAN-T5 DeepSpeed notebook (docs/planning.md, sources).
        ("google/flan-t5-xxl", 11_135_332_352, 131_596_288),
        ("google/flan-t5-xl", 2_849_757_184, 65_798_144),
        ("meta-llama/Llama-3.1-8B-Instruct", 8_030_261_248, 525_336_576),
    ],
)
def test_census_of_known_models_from_their_configs(name, params, largest):
    arch = arch_from_config(known_config(name))
    assert arch.total_params == params and arch.largest_module_params == largest
    assert not arch.tied_head and arch.head == "lm_head"


def test_flan_t5_structure_lora_targets_and_4bit_layers():
    arch = arch_from_config(known_config("google/flan-t5-xxl"))
    assert arch.is_encoder_decoder and arch.python_gelu and arch.gated_mlp and arch.dropout == 0.1
    assert (arch.layers, arch.decoder_layers, arch.hidden, arch.ffn, arch.heads) == (24, 24, 4096, 10240, 64)
    every = arch.lora_targets("all-linear")
    # q, k, v, o in 24 encoder + 2 x 24 decoder attentions, wi_0, wi_1, wo in 48 blocks; not lm_head.
    assert len(every) == 24 * 4 + 48 * 4 + 48 * 3 and all(lin.name != "lm_head" for lin in every)
    assert {lin.name.rsplit(".", 1)[-1] for lin in arch.lora_targets(["q", "v"])} == {"q", "v"}
    # bitsandbytes leaves T5's wo (its _keep_in_fp32_modules) and the head unquantized.
    assert {lin.name.rsplit(".", 1)[-1] for lin in arch.quantized_linears()} == {
        "q",
        "k",
        "v",
        "o",
        "wi_0",
        "wi_1",
    }


def test_known_table_names_the_recipes_models():
    for path in RECIPES.glob("*.yaml"):
        name = load_recipe(path).model.name_or_path
        assert name.startswith("tiny:") or name in KNOWN_CONFIGS, name


def test_trainable_and_total_match_the_built_tiny_model(cache_dir, tmp_path):
    """The census counts what lorakit's own build makes: peft's LoRA matrices and the base."""
    from lorakit.model import build_model, count_parameters

    for kind, targets in (("t5", "all-linear"), ("llama", ["q_proj", "v_proj"])):
        recipe = tiny_recipe(
            cache_dir,
            tmp_path / kind,
            model={"name_or_path": f"tiny:{kind}"},
            method={"target_modules": targets},
        )
        trainable, total = count_parameters(build_model(recipe).model)
        p = plan(recipe, gpus=1, gpu_memory="1GB", seq_len=64, target_len=16)
        assert (p.trainable_params, p.total_params) == (trainable, total), kind


def _xxl(*overrides):
    return load_recipe(RECIPES / "flan_t5_xxl_lora.yaml", ["data.max_target_length=128", *overrides])


def test_zero_stages_partition_what_they_should():
    by_stage = {}
    for stage in (0, 1, 2, 3):
        e = plan(
            _xxl("method.kind=full", f"distributed.zero_stage={stage}"), gpus=8, gpu_memory="80GB"
        ).estimate
        by_stage[stage] = {i.name: i.bytes for i in e.items}
    p = 11_135_332_352
    assert by_stage[0]["Adam states (fp32)"] == 8 * p and by_stage[1]["Adam states (fp32)"] == 8 * p // 8
    assert by_stage[1]["gradients"] == 2 * p and by_stage[2]["gradients"] == 2 * p // 8
    assert by_stage[2]["trainable weights"] == 2 * p
    # ZeRO-3 splits the weights, but keeps the parameters below its persistence threshold whole everywhere.
    assert 2 * p // 8 < by_stage[3]["trainable weights"] < 2 * p // 8 + 2 * 10**6


def test_lora_states_are_the_adapter_only_and_qlora_shrinks_the_base():
    lora = plan(_xxl(), gpus=8, gpu_memory="40GB")
    qlora = plan(_xxl("method.kind=qlora"), gpus=8, gpu_memory="40GB")
    items = {i.name: i for i in lora.estimate.items}
    assert items["Adam states (fp32)"].bytes == 8 * lora.trainable_params // 8
    base = items["frozen base weights"].bytes
    assert base == pytest.approx(2 * 11_135_332_352 / 8, rel=0.001)
    q = {i.name: i for i in qlora.estimate.items}
    # 4-bit linear layers; T5's wo, the embeddings and the head stay in bf16: ~40% of the bf16 base.
    assert 0.35 < q["frozen base weights"].bytes / base < 0.45
    assert q["4-bit quantization constants"].where == "gpu" and q["4-bit quantization constants"].bytes > 0
    # transformers loads the quantized base whole on every GPU before ZeRO-3 partitions it.
    assert q["whole 4-bit model on each GPU while loading"].bytes > 7 * q["frozen base weights"].bytes


def test_offload_moves_states_to_cpu_ram():
    none = plan(_xxl("method.kind=full"), gpus=8, gpu_memory="40GB", cpu_memory="1100GB").estimate
    opt = plan(
        _xxl("method.kind=full", "distributed.offload_optimizer=cpu"), gpus=8, gpu_memory="40GB"
    ).estimate
    both = plan(
        _xxl("method.kind=full", "distributed.offload_optimizer=cpu", "distributed.offload_params=cpu"),
        gpus=8,
        gpu_memory="40GB",
    ).estimate
    assert none.model_state_bytes("cpu") == 0
    assert both.model_state_bytes("gpu") < opt.model_state_bytes("gpu") < none.model_state_bytes("gpu")
    assert none.per_node_cpu_bytes < opt.per_node_cpu_bytes < both.per_node_cpu_bytes
    assert {i.name for i in opt.items if i.where == "cpu"} >= {"fp32 master weights", "Adam states (fp32)"}


def test_checkpointing_and_micro_batch_drive_activations():
    on = plan(_xxl(), gpus=8, gpu_memory="40GB").estimate.activations
    off = plan(_xxl("model.gradient_checkpointing=false"), gpus=8, gpu_memory="40GB").estimate.activations
    half = plan(
        _xxl("model.gradient_checkpointing=false", "train.micro_batch_size=4"), gpus=8, gpu_memory="40GB"
    )
    assert off.peak > 4 * on.peak and on.recompute > 0 and off.recompute == 0
    assert half.estimate.activations.peak == pytest.approx(off.peak / 2, rel=0.01)
    eager = plan(_xxl("model.attention=eager"), gpus=8, gpu_memory="40GB").estimate.activations
    assert eager.quadratic_per_layer > on.quadratic_per_layer


def test_auto_lengths_use_the_model_maximum_or_the_options():
    # Eval predictions generated layer by layer: gathered whole, the model would be the peak at either length.
    recipe = load_recipe(RECIPES / "flan_t5_xl_lora.yaml", ["distributed.gather_for_generation=false"])
    p = plan(recipe, gpus=8, gpu_memory="40GB")
    # packing: auto packs T5: one row of at most micro_batch_size examples of the longest length (512).
    rows = recipe.train.micro_batch_size * 512
    assert p.estimate.shape.example_len == 512 and p.estimate.shape.rows == 1
    assert (p.estimate.shape.seq_len, p.estimate.shape.target_len) == (rows, rows)
    assert any("data.max_target_length is auto" in n for n in p.assumptions)
    assert any("train.max_tokens unset" in n for n in p.assumptions)
    short = plan(recipe, gpus=8, gpu_memory="40GB", target_len=64)
    assert short.estimate.shape.target_len == recipe.train.micro_batch_size * 64
    assert short.per_gpu_bytes < p.per_gpu_bytes
    padded = plan(
        load_recipe(RECIPES / "flan_t5_xl_lora.yaml", ["data.packing=false"]), gpus=8, gpu_memory="40GB"
    )
    assert (padded.estimate.shape.seq_len, padded.estimate.shape.target_len) == (512, 512)


def test_packed_causal_rows_use_max_tokens():
    p = plan(load_recipe(RECIPES / "llama3_8b_lora.yaml"), gpu_memory="80GB")
    assert (p.estimate.shape.rows, p.estimate.shape.seq_len) == (1, 16384)
    assert p.estimate.setup.max_tokens == 16384 and "packed" in p.attention
    # Llama-3's 128k vocabulary: the bf16 logits and their gradient (and the loss's fp32 chunk) dominate a
    # 16k-token micro-batch, whose rows are too short for model.tiled_loss auto.
    a = p.estimate.activations
    assert a.head == 16384 * 128256 * (2 + 2) + 12 * CHUNK_ELEMENTS and a.head > a.kept
    tiled = plan(load_recipe(RECIPES / "llama3_8b_lora.yaml", ["model.tiled_loss=true"]), gpu_memory="80GB")
    t = tiled.estimate.activations
    assert t.logits == 0 and t.head == 12 * (CHUNK_ELEMENTS // 128256) * 128256 and t.peak < a.peak


@pytest.mark.parametrize("tile", [None, 64])
def test_the_head_term_is_what_the_loss_allocates(tile):
    """The planner's output-head bytes against the peak tensor memory of a bf16 head and loss over a row
    (hidden 16, so the head's own terms dominate): the chunked loss over logits, and the tiled loss."""
    from lorakit.meter import TensorMemoryTracker
    from lorakit.model.loss import token_loss_sum
    from lorakit.model.tiled_loss import TiledLossHead
    from lorakit.planner.activations import _head

    tokens, vocab, hidden = 512, 8192, 16
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(1, tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    with TensorMemoryTracker("cpu") as t:
        if tile:
            wrapped = TiledLossHead(head, tile)
            with wrapped.targets(labels):
                loss = wrapped(x).sum()
        else:
            # Chunks of 64 tokens, so that several pass, as for any row of a real vocabulary.
            loss = token_loss_sum(head(x), labels, chunk_elements=64 * vocab)
        loss.backward()
        del loss
        measured = t.peak - t.baseline
    arch = SimpleNamespace(vocab=vocab, hidden=hidden)
    planned, _ = _head(arch, 2, tokens, tile, chunk=64 * vocab)
    # What is left is hidden-state sized (the gradient of x, per-token losses).
    assert measured * 0.97 <= planned <= measured * 1.02


def test_recommendation_is_the_fastest_setup_that_fits_with_headroom():
    too_small = _xxl("method.kind=full", "model.gradient_checkpointing=false")
    p = plan(too_small, gpus=8, gpu_memory="40GiB", cpu_memory="1152GiB")
    assert p.fits is False and p.recommendation is not None and p.recommendation.fits
    assert p.recommendation.per_gpu_bytes <= 0.9 * 40 * 2**30
    # The overrides printed for the user turn the recipe into exactly the recommended setup.
    assert p.recommended_overrides
    applied = plan(_xxl("method.kind=full", "model.gradient_checkpointing=false", *p.recommended_overrides),
                   gpus=8, gpu_memory="40GiB", cpu_memory="1152GiB")  # fmt: skip
    assert applied.fits and applied.per_gpu_bytes == p.recommendation.per_gpu_bytes
    assert applied.estimate.setup == p.recommendation.setup
    # Keeping the optimizer batch: the recipe packs T5 (rows planned at up to 8 x 512 tokens), so a smaller
    # packed row gets proportionally more accumulation steps.
    t = _xxl(*p.recommended_overrides).train
    assert t.max_tokens * t.gradient_accumulation_steps == 8 * 512
    # A recipe that already fits is its own recommendation unless something faster fits.
    fits_plain = plan(_xxl(), gpus=8, gpu_memory="80GB")
    assert fits_plain.fits and fits_plain.recommendation.slowdown <= fits_plain.estimate.slowdown


def test_slowdown_costs():
    base = Setup(2, "none", "none", 8, None, False)
    assert slowdown(base, base, adapter=True, nodes=1) == 1.0
    ck = Setup(2, "none", "none", 8, None, True)
    assert slowdown(ck, base, adapter=False, nodes=1) == pytest.approx(4 / 3)
    assert slowdown(ck, base, adapter=True, nodes=1) == pytest.approx(1.5)
    z3 = Setup(3, "cpu", "cpu", 2, None, False)
    assert slowdown(z3, base, adapter=False, nodes=2) == pytest.approx(1.5 * 1.5 * 2.0 * 1.1**2)


def test_no_verdict_without_a_capacity_and_errors_name_the_field(tmp_path):
    p = plan(_xxl(), gpus=8)
    assert p.fits is None and p.recommendation is None and p.per_gpu_bytes > 0
    with pytest.raises(PlanError, match="does not know this model"):
        plan(_xxl("model.name_or_path=some-org/unknown-model"), gpus=8, gpu_memory="40GB")
    with pytest.raises(PlanError, match="gpus"):
        plan(_xxl(), gpus=0, gpu_memory="40GB")
    with pytest.raises(PlanError, match="no config.json"):
        plan(_xxl(f"model.name_or_path={tmp_path}"), gpus=8, gpu_memory="40GB")


def test_local_config_json_is_read_without_weights(tmp_path):
    known_config("google/flan-t5-xl").save_pretrained(tmp_path)
    local = plan(_xxl(f"model.name_or_path={tmp_path}"), gpus=8, gpu_memory="40GB")
    hub = plan(_xxl("model.name_or_path=google/flan-t5-xl"), gpus=8, gpu_memory="40GB")
    assert local.per_gpu_bytes == hub.per_gpu_bytes and local.total_params == hub.total_params


def test_to_dict_is_json_with_the_agreed_keys_and_describe_reads():
    p = lorakit.plan(str(RECIPES / "flan_t5_xxl_lora.yaml"), gpus=8, gpu_memory="40GB", target_len=128)
    d = json.loads(json.dumps(p.to_dict()))
    assert d["fits"] is True and d["per_gpu_bytes"] == p.per_gpu_bytes
    assert d["per_node_cpu_bytes"] == p.per_node_cpu_bytes
    assert set(d["recommended"]["setup"]) == {
        "zero_stage", "offload_optimizer", "offload_params", "micro_batch_size", "max_tokens",
        "gradient_checkpointing", "checkpoint_every",
    }  # fmt: skip
    assert d["gradient_checkpointing"] == {
        "mode": "whole",
        "every": None,
        "why": d["gradient_checkpointing"]["why"],
    }
    text = p.describe()
    assert "verdict: the recipe as written fits" in text and "framework overhead" in text
    # docs/faults.md: the plan shows how long a collective waits for a stalled rank.
    assert d["timeout_minutes"] == 30
    assert "a stalled rank fails collectives after 30 min (distributed.timeout_minutes)" in text


def test_packed_rows_shrink_to_fit_and_the_overrides_reproduce_the_plan():
    p = plan(RECIPES / "llama3_8b_lora.yaml", gpu_memory="16GB")
    # 16k-token rows: about 20 GiB per GPU (the head's logits, their gradient and the loss's chunk 8 GiB).
    assert p.fits is False and p.recommendation is not None
    rec = p.recommendation
    assert 4096 <= rec.setup.max_tokens < 16384  # never below the longest example (data.max_length)
    fixed = load_recipe(RECIPES / "llama3_8b_lora.yaml", list(p.recommended_overrides))
    again = plan(fixed, gpu_memory="16GB")
    assert again.fits and again.estimate.setup == rec.setup and again.per_gpu_bytes == rec.per_gpu_bytes
    # The same tokens per optimizer step: smaller rows, more accumulation.
    assert fixed.train.max_tokens * fixed.train.gradient_accumulation_steps == 16384 * 2


def test_a_cpu_run_counts_a_cpu_process_runtime_not_a_cuda_one():
    from lorakit.planner.core import CPU_RUN_PROCESS_BYTES, PROCESS_CPU_BYTES

    recipe = _xxl()
    cuda, cpu = plan(recipe, gpus=2, gpu_memory="40GB"), plan(recipe, gpus=2, device="cpu")
    # On a CPU the "GPU" tensors are in RAM too; the runtime is 0.5 GiB a process, not 3 (benchmarks/rehearsal.py).
    e = cpu.estimate
    beyond_runtime = cuda.per_node_cpu_bytes - 2 * PROCESS_CPU_BYTES  # the loading peak, the same on both
    assert beyond_runtime >= 0
    assert e.per_node_cpu_bytes == 2 * (CPU_RUN_PROCESS_BYTES + e.gpu_allocated) + beyond_runtime
    assert "~0.5 GiB per process" in cpu.describe() and "~3 GiB per process" in cuda.describe()


def test_cpu_phases_count_the_loading_peak_while_loading_only():
    """A step's planned bytes are the runtime and the training peak: the fp32 layer read while loading
    (Llama-3-8B's 2 GiB embedding) is the load phase's, though the run's per-node peak includes it."""
    from lorakit.planner.core import CPU_RUN_PROCESS_BYTES
    from lorakit.planner.phases import cpu_phases

    name = "meta-llama/Meta-Llama-3-8B"
    overrides = [f"model.name_or_path={name}", "distributed.num_processes=2", "distributed.zero_stage=3"]
    recipe = load_recipe(RECIPES / "quickstart_causal.yaml", overrides)
    config = known_config(name)
    e = plan(recipe, device="cpu", config=config).estimate
    loading = sum(i.bytes for i in e.items if i.when == "load")
    assert loading > 1.9 * 2**30  # the embedding in fp32
    phases = cpu_phases(recipe, config=config)
    assert phases["first_step"] == phases["steady"] == CPU_RUN_PROCESS_BYTES + e.gpu_allocated
    assert phases["load"] > phases["save"] and phases["steady"] < e.per_node_cpu_bytes // 2
