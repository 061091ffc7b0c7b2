"""Sequence parallelism (distributed.sequence_parallel: 2) on 2 CPU processes against 1.

One torchrun launch of sequence_parallel_worker checks the model side on a fixed packed row for a tiny
Llama, Qwen2 and Mistral (an example longer than its sliding window) (fp32, LoRA, gradient checkpointing
tiled MLPs and tiled loss on the split model) and the tiny Llama fully fine-tuned: the same loss and the same gradients
as the whole row on one rank, and packed examples kept apart across the split. The same launch then trains a recipe (ZeRO-3, checkpointing) with sequence_parallel 2
to the end against the same recipe on one process (its MLPs, head and loss in tiles under ZeRO-3:
model.tiled_mlp and model.tiled_loss are auto-on with sequence parallelism, off on one process), on a
two-source mixture whose eval losses per source must agree too; the same launch trains one step of it on
FSDP2 (strategy fsdp), whose loss must be one process's, and the recipe with LoRA dropout on, which a second
launch (fresh processes: only the checkpoint carries each rank's RNG and the optimizer state over) resumes
from its step-2 checkpoint and must end as it did. The worker records a check that raises and goes on, so
one failure hides no other.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

import lorakit
from lorakit import rundir
from lorakit.engine.launch import torchrun_command
from lorakit.recipe import recipe_from_dict
from tests.conftest import ROOT, tiny_recipe_dict
from tests.integration.qlora_worker import finished, train_in_one_launch
from tests.unit.test_mixture import DIALOGUES, NEWS

KINDS = ("llama", "qwen2", "mistral", "llama-full", "llama-qlora")


@pytest.fixture(scope="module")
def launched(cache_dir, tmp_path_factory) -> tuple[dict, dict[str, Path]]:
    """One 2-process launch of sequence_parallel_worker: the model-side checks (what it measured), then the
    recipe runs (their run directories; see sp_runs)."""
    base = tmp_path_factory.mktemp("sp")
    out = base / "measured.json"
    runs, recipes = _recipe_runs(cache_dir, base)
    for path, raw in recipes.items():
        path.write_text(yaml.safe_dump(raw))
        lorakit.prepare(lorakit.load_recipe(str(path)))  # tokenize here; the workers only read the cache
    args = [str(cache_dir), str(out), *KINDS, "--train", *map(str, recipes)]
    proc = subprocess.run(
        torchrun_command(2, "tests.integration.sequence_parallel_worker", args),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text()), runs


@pytest.fixture(scope="module")
def measured(launched) -> dict:
    return launched[0]


def _checked(measured: dict, name: str) -> dict:
    """What the worker measured for `name`; a check that raised fails its own tests with its traceback."""
    assert "error" not in measured[name], measured[name]["error"]
    return measured[name]


@pytest.mark.parametrize("kind", KINDS)
def test_split_row_gives_the_whole_rows_loss_and_gradients(measured, kind):
    m = _checked(measured, kind)
    assert m["target_tokens_split"] == m["target_tokens_whole"] > 0
    assert m["loss_split"] == pytest.approx(m["loss_whole"], rel=1e-6)
    # LoRA: A and B of 7 linears x 2 layers; full fine-tuning: every weight of the tiny Llama.
    assert m["grad_count"] == (21 if kind.endswith("full") else 28) and m["grad_norm"] > 0
    # Relative to each gradient's largest entry: fp32 sums in another order, nothing more.
    assert m["grad_rel_diff"] < 1e-5
    # The split model ran its 2 layers' MLPs in tiles, and its head and loss in tiles of its own shard.
    assert m["tiled_mlps"] == 2 and m["shard_tokens"] > 8 and m["tiled_loss"]
    assert m["head_tokens"] and set(m["head_tokens"]) == {m["shard_tokens"]}


@pytest.mark.parametrize("engine", ["zero2", "zero3-qlora", "zero3-full"])
def test_deepspeed_averages_the_split_rows_gradients(measured, engine):
    m = _checked(measured, engine)
    assert m["grad_count"] == (21 if engine.endswith("full") else 28) and m["grad_rel_diff"] < 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_split_row_keeps_packed_examples_apart(measured, kind):
    for changed, diff in _checked(measured, kind)["isolation"].items():
        assert diff["itself"] > 1e-2, changed  # the change is visible where it was made...
        assert diff["others"] < 1e-5, changed  # ...and nowhere else, on either rank


# --- a recipe run: sequence_parallel 2 on 2 processes against 1 process -----------------------------------
# Steps 1-2, a checkpoint at 2, and one step after it (what the resumed run repeats).
STEPS = 3


def _run_recipe(cache_dir, out, sp: int, strategy: str = "deepspeed", **train) -> dict:
    return tiny_recipe_dict(
        cache_dir,
        out,
        model={
            "name_or_path": "tiny:llama",
            "gradient_checkpointing": True,
            "attention": "sdpa",
            "mlp_tile_tokens": 16,
            "loss_tile_tokens": 16,
        },
        data={
            "source": [NEWS, {**DIALOGUES, "name": "chats"}],
            "format": "instruction",
            "max_length": "auto",
            "max_samples": 24,
            "max_eval_samples": 2,  # per source
        },
        train={"max_steps": STEPS, "max_tokens": 256, "gradient_accumulation_steps": 2, **train},
        distributed={"num_processes": sp, "zero_stage": 3, "sequence_parallel": sp, "strategy": strategy},
        eval={"generate": True, "max_new_tokens": 4},
        checkpoint={"every": 2, "keep": 2},
        output={"merge": sp > 1 and strategy == "deepspeed"},
    )


def _train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rundir.read_metrics(run_dir) if r["kind"] == "train"}


def _records(run_dir: Path, kind: str, key: str) -> list:
    return [r[key] for r in rundir.read_metrics(run_dir) if r["kind"] == kind]


def _recipe_runs(cache_dir, base: Path) -> tuple[dict[str, Path], dict[Path, dict]]:
    """One process, sequence_parallel 1 (trained here, in this process); and the recipes of the 2-process
    runs: sequence_parallel 2 to the end (merging), the same recipe resumed from the first run's step-2
    checkpoint, and one step on FSDP2. The run directories by name, and the recipes by YAML path."""
    runs = {name: base / name for name in ("one", "split", "dropout", "split-fsdp")}
    lorakit.train(recipe_from_dict(_run_recipe(cache_dir, runs["one"], 1)))
    recipes = {
        base / "split.yaml": _run_recipe(cache_dir, runs["split"], 2),
        # FSDP2 with sequence parallelism: one step is enough to hold its loss to one process's.
        base / "split-fsdp.yaml": _run_recipe(cache_dir, runs["split-fsdp"], 2, "fsdp", max_steps=1),
        base / "dropout.yaml": _dropout_recipe(cache_dir, runs["dropout"]),
    }
    return runs, recipes


def _dropout_recipe(cache_dir, out: Path, **train) -> dict:
    """The split run with LoRA dropout on (each rank draws the masks of its half of the row), without
    evaluation or merge."""
    raw = _run_recipe(cache_dir, out, 2, **train)
    raw["method"]["dropout"] = 0.1
    raw["eval"]["enabled"], raw["output"]["merge"] = False, False
    return raw


@pytest.fixture(scope="module")
def resumed(cache_dir, sp_runs, tmp_path_factory):
    """The dropout run resumed from its step-2 checkpoint in a launch of its own: (its directory, the
    launch)."""
    base = tmp_path_factory.mktemp("sp-resumed")
    step2 = sp_runs["dropout"] / "checkpoints" / "step-00000002"
    recipe = _dropout_recipe(cache_dir, base / "resumed", resume=str(step2))
    launch = train_in_one_launch({base / "resumed.yaml": recipe}, {"PYTHONPATH": str(ROOT)}, keep_going=True)
    return base / "resumed", launch


@pytest.fixture(scope="module")
def sp_runs(launched) -> dict[str, Path]:
    return launched[1]


def test_a_split_run_sees_the_rows_of_one_process_in_the_same_order(sp_runs):
    one, split = _train_losses(sp_runs["one"]), _train_losses(sp_runs["split"])
    assert sorted(split) == list(range(1, STEPS + 1))
    assert split[1] == pytest.approx(one[1], rel=1e-6)
    # Later steps follow the same trajectory (fp32 sums in another order only).
    assert [split[s] for s in sorted(split)] == pytest.approx([one[s] for s in sorted(one)], rel=1e-4)
    # The token counts of every step are the whole rows', counted once per sequence-parallel group.
    assert _records(sp_runs["split"], "train", "target_tokens") == _records(
        sp_runs["one"], "train", "target_tokens"
    )
    # Evaluation: the eval rows split over the group as in training give the whole rows' loss; generation
    # runs whole prompts, each group's once.
    # Each source's eval loss too, from the tokens of its rows each rank's shard holds.
    for key in ("loss", "news_summaries/loss", "chats/loss"):
        evals = _records(sp_runs["split"], "eval", key)
        assert evals and evals == pytest.approx(_records(sp_runs["one"], "eval", key), rel=1e-5), key
    assert evals[0] != pytest.approx(_records(sp_runs["split"], "eval", "news_summaries/loss")[0], rel=1e-3)
    predictions = [(sp_runs[r] / rundir.PREDICTIONS).read_text().splitlines() for r in ("split", "one")]
    assert len(predictions[0]) == 4 and predictions[0] == predictions[1]  # 2 rows of each source


def test_sequence_parallel_on_fsdp_gives_one_process_first_step(sp_runs):
    fsdp, one = _train_losses(sp_runs["split-fsdp"]), _train_losses(sp_runs["one"])
    assert rundir.read_summary(sp_runs["split-fsdp"])["strategy"] == "fsdp"
    assert fsdp[1] == pytest.approx(one[1], rel=1e-3)


def test_a_split_run_merges(sp_runs):
    merged = rundir.read_summary(sp_runs["split"])["merged_dir"]
    assert (Path(merged) / "config.json").is_file() and list(Path(merged).glob("*.safetensors"))


def test_a_split_run_with_dropout_resumed_in_a_fresh_process_repeats_the_run(sp_runs, resumed):
    whole, (again, launch) = sp_runs["dropout"], resumed
    finished(launch, again)
    summary = rundir.read_summary(again)
    assert summary["resumed_from"]["step"] == 2 and summary["steps"] == STEPS
    after = {s: loss for s, loss in _train_losses(whole).items() if s > 2}
    assert sorted(after) == [3]
    assert {s: loss for s, loss in _train_losses(again).items() if s > 2} == pytest.approx(after, abs=1e-6)
    a = load_file(str(whole / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(again / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
