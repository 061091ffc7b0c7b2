"""lorakit: LoRA and QLoRA fine-tuning of large language models on DeepSpeed ZeRO.

import lorakit
result = lorakit.train(lorakit.load_recipe("recipes/quickstart.yaml", ["train.epochs=1"]))
"""

import lorakit.objectives  # noqa: F401  (registers the built-in objectives and their recipe sections)
from lorakit import backends as _backends
from lorakit.errors import DataError, LorakitError, RecipeError
from lorakit.recipe import Recipe, load_recipe

# The sharding backends' recipe checks run whenever a recipe validates (the recipe package cannot import them).
_backends.install_recipe_checks()

__version__ = "0.1.0"


def train(recipe, train_dataset=None, eval_dataset=None):
    """Train a recipe; returns TrainResult(run_dir, summary). `train_dataset` / `eval_dataset`
    (datasets.Dataset) replace data.source's rows (docs/data.md). See lorakit.api.train."""
    from lorakit.api import train as _train

    return _train(recipe, train_dataset=train_dataset, eval_dataset=eval_dataset)


def merge(source, output, **options):
    """Merge a run's LoRA adapter into its base (or re-export a full run) as safetensors in `output`,
    verified; returns MergeResult. Options: dtype, max_shard_size, base, force, tolerance,
    compare_quantized, strategy (auto | stream | memory), verify (auto | always | never). See
    lorakit.export.merge."""
    from lorakit.export import merge as _merge

    return _merge(source, output, **options)


def generate(source, inputs, **options):
    """Run a trained model (run, adapter or merged model directory) on `inputs` (a JSONL or text file, "-",
    or a list of rows and texts) with the run's prompt template; returns GenerateResult(records, ...).
    Options: output, max_new_tokens, num_beams, batch_size, device, dtype. See lorakit.inference.generation
    and docs/inference.md."""
    from lorakit.inference import generate as _generate

    return _generate(source, inputs, **options)


def evaluate(source, split=None, overrides=(), **options):
    """A trained run's metrics on `split` of its data (default: its eval split) with its recipe and dotted
    overrides, computed as training evaluates; writes RUN/evaluate-SPLIT.json and returns EvaluateResult.
    Options: output, device. See lorakit.inference.split_eval and docs/inference.md."""
    from lorakit.inference import evaluate as _evaluate

    return _evaluate(source, split, overrides, **options)


def plan(recipe, **options):
    """Plan a recipe's memory before renting GPUs: per-GPU and per-node CPU bytes, a fits verdict and the
    best setup that fits; returns a MemoryPlan. Options: gpus (default: the recipe's num_processes),
    gpu_memory, nodes, cpu_memory, config, seq_len, target_len, device. See lorakit.planner.plan and
    docs/planning.md."""
    from lorakit.planner import plan as _plan

    return _plan(recipe, **options)


def compare(run_dirs, **options):
    """Put runs side by side: report.md with a table and PNG plots; returns the Comparison. Options:
    output, gpu_hour_price. See lorakit.report.compare and docs/compare.md."""
    from lorakit.report import compare as _compare

    return _compare(run_dirs, **options)


def push(source, repo_id, **options):
    """Push a run's adapter (or model), its merged export when it has one, or an export directory to the
    Hugging Face Hub repository `repo_id` in one commit with a model card; returns PushResult. Options:
    private, revision, create_pr. See lorakit.export.publish and docs/publish.md."""
    from lorakit.export.publish import push as _push

    return _push(source, repo_id, **options)


def doctor(recipe=None, **options):
    """Check this machine for a recipe before a long run (environment, contracts on a small model of its
    architecture, one block's speed, the memory plan); returns a DoctorReport (`ok`, `checks`, `write`).
    Options: quick, output, devices. See lorakit.doctor and docs/doctor.md."""
    from lorakit.doctor import run_doctor

    return run_doctor(recipe, **options)


def prepare(recipe):
    """Tokenize and cache a recipe's data without training. See lorakit.preflight.prepare."""
    from lorakit.preflight import prepare as _prepare

    return _prepare(recipe)


__all__ = [
    "DataError",
    "LorakitError",
    "Recipe",
    "RecipeError",
    "__version__",
    "compare",
    "doctor",
    "evaluate",
    "generate",
    "load_recipe",
    "merge",
    "plan",
    "prepare",
    "push",
    "train",
]
