"""lorakit doctor on CPU: every check runs and passes for a T5 and a Llama-style recipe; a broken kernel
injected here (an attention that leaks across packed examples, a loss off by a factor) makes it fail and
name the check; preflight.doctor stops a run before it trains."""

from __future__ import annotations

import pytest

import lorakit
from lorakit.doctor import run_doctor
from lorakit.model import inputs
from tests.conftest import RECIPES

# Every check the doctor has; on a CPU with one process all_reduce and the ZeRO-3 save are skipped with a
# reason, everything else runs.
CHECKS = {
    "python + torch", "libraries", "gpus", "driver + nccl", "flash-attn", "bitsandbytes", "cpu bf16 matmul",
    "deepspeed ops",
    "fsdp", "extension locks", "disk", "packed == alone", "chunked CE == full CE", "LoRA merged == adapter",
    "token-weighted accumulation", "ZeRO-3 save + reload", "block forward+backward", "run time estimate",
    "all_reduce", "memory plan",
}  # fmt: skip
# fsdp: the recipes train on DeepSpeed.
SKIPPED_ON_ONE_CPU = {"gpus", "driver + nccl", "fsdp", "ZeRO-3 save + reload", "all_reduce"}
ENVIRONMENT = {
    "python + torch", "libraries", "gpus", "driver + nccl", "flash-attn", "bitsandbytes", "cpu bf16 matmul",
    "deepspeed ops",
    "fsdp", "extension locks", "disk",
}  # fmt: skip


def _recipe(name: str, cache_dir, tmp_path, *overrides: str):
    return lorakit.load_recipe(
        RECIPES / name, [f"data.cache_dir={cache_dir}", f"output.dir={tmp_path / 'run'}", *overrides]
    )


def test_every_check_passes_for_a_t5_recipe(cache_dir, tmp_path):
    # Shorter T5 rows than the quickstart's 512-token sources keep the timed block quick on 2 cores.
    recipe = _recipe(
        "quickstart.yaml", cache_dir, tmp_path, "data.max_source_length=128", "data.max_samples=64"
    )
    report = run_doctor(recipe, quick=True, output=tmp_path / "doctor")
    assert report.ok, report.table()
    assert {c.name for c in report.checks} == CHECKS
    assert {c.name for c in report.checks if c.status == "skip"} <= SKIPPED_ON_ONE_CPU
    packing = next(c for c in report.checks if c.name == "packed == alone")
    assert "encoder self, decoder self and cross attention" in packing.detail
    assert packing.data["attention"] == "lorakit_varlen_sdpa"
    assert (tmp_path / "doctor" / "doctor.json").is_file() and (tmp_path / "doctor" / "doctor.md").is_file()


def test_a_leaking_attention_and_a_loss_off_by_a_factor_fail_the_doctor_and_are_named(
    cache_dir, tmp_path, monkeypatch
):
    """The injected kernels: packed rows handed to per-example SDPA as one example, so every token attends
    to the examples before it; and a token loss 5% too large."""
    from lorakit.model import loss

    monkeypatch.setattr(inputs, "_bounds", lambda segments: (0, segments.numel()))
    real = loss.token_loss_sum
    monkeypatch.setattr(loss, "token_loss_sum", lambda *a, **k: 1.05 * real(*a, **k))
    report = run_doctor(
        _recipe("quickstart_causal.yaml", cache_dir, tmp_path), quick=True, sections=("contracts",)
    )
    checks = {c.name: c for c in report.checks}
    assert not report.ok
    leak = checks["packed == alone"]
    assert leak.status == "fail" and "leaked on this backend (lorakit_varlen_sdpa)" in leak.meaning
    assert leak.data["max_relative_logit_diff"] > 5 * leak.data["tolerance"]
    assert "model.attention: sdpa" in leak.action
    assert (
        checks["chunked CE == full CE"].status == "fail"
        and "wrong loss" in checks["chunked CE == full CE"].meaning
    )
    # The accumulation contract runs on packed rows too: with the leak, a row of all examples differs from
    # two rows of fewer. The merge contract does not pack and takes no loss: it still passes.
    assert {c.name for c in report.failures} <= {
        "packed == alone",
        "chunked CE == full CE",
        "token-weighted accumulation",
    }
    assert checks["LoRA merged == adapter"].passed
    assert "FAILED contracts/packed == alone" in report.table()


def test_preflight_doctor_stops_the_run_before_training(cache_dir, tmp_path, monkeypatch):
    from lorakit.doctor.preflight import PreflightFailed

    monkeypatch.setattr(inputs, "_bounds", lambda segments: (0, segments.numel()))
    recipe = _recipe("quickstart_causal.yaml", cache_dir, tmp_path, "preflight.doctor=true",
                     "distributed.num_processes=1", "data.max_samples=32")  # fmt: skip
    with pytest.raises(PreflightFailed, match="packed == alone") as err:
        lorakit.train(recipe)
    assert err.value.exit_code == 3
    assert (tmp_path / "run" / "doctor" / "doctor.md").is_file()
    assert not (tmp_path / "run" / "summary.json").exists() and not (tmp_path / "run" / "adapter").exists()


def test_contracts_of_an_architecture_without_a_tiny_kind(cache_dir, tmp_path):
    """A Cohere2 config (full and sliding-window layers; no lorakit family, so no tiny kind: Gemma 2 has one
    now) in a local directory: the contracts run on its own architecture at small width, the sliding window
    shortened so the examples cross it."""
    from transformers import Cohere2Config

    Cohere2Config(hidden_size=1024, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=4, head_dim=64, vocab_size=32000).save_pretrained(tmp_path / "cohere2")  # fmt: skip
    recipe = _recipe("quickstart_causal.yaml", cache_dir, tmp_path, f"model.name_or_path={tmp_path / 'cohere2'}",
                     "model.dtype=float32")  # fmt: skip
    report = run_doctor(recipe, quick=True, sections=("contracts",))
    assert report.ok, report.table()
    packing = next(c for c in report.checks if c.name == "packed == alone")
    assert "64-token sliding window" in packing.detail and packing.data["tolerance"] == 1e-4


@pytest.mark.parametrize(
    ("kind", "base", "overrides"),
    [
        ("mixtral", "quickstart_causal.yaml", ("model.dtype=bfloat16",)),
        ("qwen3_moe", "quickstart_causal.yaml", ("model.dtype=bfloat16",)),
        ("olmoe", "quickstart_causal.yaml", ("model.dtype=bfloat16",)),
        ("t5gemma", "quickstart.yaml", ("data.max_source_length=64",)),
    ],
)
def test_the_quick_doctor_passes_for_the_moe_families_and_t5gemma(kind, base, overrides, cache_dir, tmp_path):
    """The quick doctor's recipe sections (contracts, speed, plan; the environment checks do not depend on
    the model and pass above) on each family's tiny model: packing, chunked CE, merge and accumulation hold
    for the expert LoRA and T5Gemma's stacks, the block is timed and the plan fits. The MoE families in bf16,
    the quickstart's dtype, with its dropout 0.05: the merge contract probes them with the routing fixed."""
    recipe = _recipe(base, cache_dir, tmp_path, f"model.name_or_path=tiny:{kind}", "data.max_samples=32",
                     *overrides)  # fmt: skip
    report = run_doctor(recipe, quick=True, sections=("contracts", "speed", "plan"))
    assert report.ok, report.table()
    assert {c.name for c in report.checks} == CHECKS - ENVIRONMENT
    assert {c.name for c in report.checks if c.status == "skip"} == {"ZeRO-3 save + reload", "all_reduce"}
    # Every tiny kind has 2 layers per stack (T5Gemma's in its encoder and decoder configs).
    assert (
        "(2 layers at the block's speed"
        in next(c for c in report.checks if c.name == "run time estimate").detail
    )
