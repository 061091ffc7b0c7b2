"""T5Gemma end to end on one CPU process: packed LoRA SFT (eager attention) with generation in its
evaluation, the merge verified, generate from the merged model, and packed seq2seq DPO; both trainings'
losses fall (a run whose update went the wrong way would train, merge and generate just as well)."""

import json
import math

import pytest

import lorakit
from lorakit import rundir
from tests.conftest import tiny_recipe

MODEL = {"name_or_path": "tiny:t5gemma", "attention": "eager"}


@pytest.mark.slow
def test_t5gemma_trains_packed_merges_verified_generates_and_runs_dpo(cache_dir, tmp_path, capsys):
    sft = tiny_recipe(cache_dir, tmp_path / "sft", model=MODEL, train={"max_steps": 3, "lr": 1e-2},
                      data={"max_samples": 16, "max_eval_samples": 4}, eval={"max_new_tokens": 4})  # fmt: skip
    run = lorakit.train(sft)
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["attention"] == "eager" and summary["packing_efficiency"] > 0.9, summary
    assert "rouge1" in json.dumps(summary["eval"])
    # The decoder started on the checkpoint's decoder bos (3, not the pad 0), and the run says so.
    start = {"token_id": 3, "token": "<s>", "field": "decoder.bos_token_id"}
    assert summary["decoder_start"] == start, summary["decoder_start"]
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("decoder start:")]
    assert said == ["decoder start: token 3 ('<s>', the checkpoint's config.decoder.bos_token_id)"], said
    sft_losses = [r["loss"] for r in rundir.read_metrics(run.run_dir) if r["kind"] == "train"]
    assert len(sft_losses) == 3 and sft_losses[-1] < sft_losses[0], sft_losses
    merged = lorakit.merge(run.run_dir, tmp_path / "merged")
    assert all(c.passed for c in merged.checks) and merged.checks[0].effect_visible
    generation = json.loads((tmp_path / "merged" / "generation_config.json").read_text())
    assert generation["decoder_start_token_id"] == 3, generation
    out = lorakit.generate(
        tmp_path / "merged", [{"article": "The council met on Tuesday."}], max_new_tokens=4
    )
    assert len(out.records) == 1 and isinstance(out.records[0]["output"], str)

    from tests.integration.test_dpo import _recipe

    dpo = _recipe(cache_dir, tmp_path / "dpo", "t5gemma", model=MODEL, data={"max_samples": 48,
                  "max_eval_samples": 8}, train={"max_steps": 3}, eval={"every": 3})  # fmt: skip
    result = lorakit.train(dpo)
    losses = [r["loss"] for r in rundir.read_metrics(result.run_dir) if r["kind"] == "train"]
    # DPO starts at log 2 (policy == reference) and the packed pairs lower it.
    assert losses[0] == pytest.approx(math.log(2), abs=1e-3) and losses[-1] < losses[0] - 0.01, losses
