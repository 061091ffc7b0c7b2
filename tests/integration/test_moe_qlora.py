"""QLoRA on an MoE end to end: the shipped causal quickstart recipe with only the model changed (tiny Mixtral,
method.kind qlora, so the attention layers and the fused experts are 4-bit), 2 processes under its ZeRO-3, the
recipe's dropout 0.05; then merged into the unquantized base, verified, and compared with the adapter on the
4-bit base."""

import json
import math

import pytest
import yaml

from tests.bnb_layout import ENV as AVX512BF16_ENV
from tests.conftest import RECIPES
from tests.integration.test_resume import launch


@pytest.mark.slow
def test_the_causal_quickstart_as_qlora_on_a_tiny_mixtral_trains_on_two_ranks_and_merges_verified(
    cache_dir, tmp_path
):
    import lorakit

    raw = yaml.safe_load((RECIPES / "quickstart_causal.yaml").read_text())
    raw["model"]["name_or_path"] = "tiny:mixtral"
    raw["method"]["kind"] = "qlora"
    # Small: a few steps, an evaluation between them (where bitsandbytes' AVX512-BF16 CPU branch would switch
    # its 4-bit linear layers' layout; forced on below), no generation.
    raw["data"].update({"cache_dir": str(cache_dir), "max_samples": 64, "max_eval_samples": 8})
    raw["train"].update({"max_steps": 6, "epochs": 1})
    raw["eval"] = {"generate": False, "every": 3}
    raw["output"]["dir"] = str(tmp_path / "run")
    assert raw["method"]["dropout"] == 0.05 and raw["distributed"] == {"num_processes": 2, "zero_stage": 3}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))

    proc = launch(path, **{AVX512BF16_ENV: "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("none on the fused experts") == 1
    assert "expert adapters (4 fused stacks) received gradients in the first step" in proc.stdout
    run_dir = tmp_path / "run"
    summary = json.loads((run_dir / "summary.json").read_text())
    q = summary["quantization"]
    assert 0 < q["quantized_expert_params"] < q["quantized_params"]
    losses = [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
              if r.get("kind") == "train"]  # fmt: skip
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-2:]) < sum(losses[:2])

    result = lorakit.merge(run_dir, tmp_path / "merged", compare_quantized=True)
    assert result.strategy == "memory" and all(c.passed for c in result.checks), result
    assert result.checks[0].effect_visible
