"""What every lorakit command line does alike: overrides anywhere among the options, sizes with their
unit, advice that fits the recipe it is given, and a recipe's own advice that works as written."""

from __future__ import annotations

import importlib
import re

import pytest

from lorakit.recipe import load_recipe
from tests.conftest import RECIPES
from tests.docs.test_recipes_comments import RECIPE_FILES, header

RECIPE = str(RECIPES / "quickstart_causal.yaml")


def _code(main, argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's own refusal (a usage line, exit 2)
        return e.code


def _commands():
    # Modules by name: lorakit.plan, .prepare and .run are also the API's functions of those names.
    plan, prepare, run, doctor, slurm = map(
        importlib.import_module,
        ("lorakit.plan", "lorakit.prepare", "lorakit.run", "lorakit.doctor.cli", "lorakit.slurm.__main__"),
    )
    return {
        "run": (run.main, ["--worker"]),
        "prepare": (prepare.main, ["--show", "1"]),
        "plan": (plan.main, ["--gpus", "1", "--gpu-memory", "24GB"]),
        "slurm": (slurm.main, ["--nodes", "1", "--gpus-per-node", "1"]),
        "doctor": (doctor.main, ["--quick"]),
    }


@pytest.mark.parametrize("command", ["run", "prepare", "plan", "slurm", "doctor"])
def test_overrides_are_read_after_the_options_by_every_command(command, tmp_path, capsys):
    main, options = _commands()[command]
    # A key the recipe refuses: read as an override, it is the recipe's error naming it (before any work).
    code = _code(main, [RECIPE, *options, f"output.dir={tmp_path / 'run'}", "train.no_such_key=1"])
    err = capsys.readouterr().err
    assert "unrecognized arguments" not in err, err
    assert code == 2 and "train.no_such_key" in err, err


def test_the_evaluate_command_reads_overrides_after_its_options():
    from lorakit.evaluate import parser

    args = parser().parse_intermixed_args(["RUN", "--split", "test", "data.max_eval_samples=4"])
    assert args.source == "RUN" and args.overrides == ["data.max_eval_samples=4"]


@pytest.mark.parametrize("flag", ["--gpu-memory", "--cpu-memory"])
def test_a_size_without_a_unit_is_refused_by_plan(flag, capsys):
    main = importlib.import_module("lorakit.plan").main
    assert main([RECIPE, "--gpus", "1", "--gpu-memory", "24GB", flag, "24"]) == 2
    err = capsys.readouterr().err
    assert f"error: {flag}: '24' has no unit: give one, e.g. 24GB" in err, err


def test_a_size_without_a_unit_is_refused_by_slurm(tmp_path, capsys):
    from lorakit.slurm.__main__ import main

    args = [
        RECIPE,
        f"output.dir={tmp_path / 'run'}",
        "--nodes",
        "1",
        "--gpus-per-node",
        "1",
        "--gpu-memory",
        "80",
    ]
    assert main(args) == 2
    assert "error: --gpu-memory: '80' has no unit" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("kind", "advised"), [("qlora", False), ("lora", True)])
def test_the_advice_when_nothing_fits_offers_qlora_only_to_a_recipe_without_it(
    kind, advised, tmp_path, capsys
):
    main = importlib.import_module("lorakit.plan").main
    overrides = [f"data.cache_dir={tmp_path / 'cache'}", f"method.kind={kind}"]
    if kind == "qlora":
        overrides.append("method.quant_type=nf4")
    # 20 MB GPUs: nothing fits, not even the recipe's smallest setup.
    assert main([RECIPE, *overrides, "--gpus", "1", "--gpu-memory", "20MB"]) == 1
    (advice,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("no setup tried")]
    assert ("QLoRA" in advice) == advised, advice


# Advice in a recipe's header in the form a user types it: "run it with `KEY=VALUE ...`", "use KEY: VALUE".
TYPED = re.compile(r"`((?:[\w.]+=\S+ ?)+)`")
WRITTEN = re.compile(r"\buse ((?:[a-z_]+\.)+[a-z_]+): ([\w.-]+)")


def _advice(text: str) -> list[list[str]]:
    flat = " ".join(text.split())
    found = [m[1].split() for m in TYPED.finditer(flat)]
    return found + [[f"{m[1]}={m[2].rstrip('.')}"] for m in WRITTEN.finditer(flat)]


def test_advice_is_read_from_a_header():
    assert _advice("On 40 GB cards use method.kind: lora (the base") == [["method.kind=lora"]]
    assert _advice("run it with\n# `method.kind=lora method.quant_type=null` (a") == [
        ["method.kind=lora", "method.quant_type=null"]
    ]


@pytest.mark.parametrize("path", RECIPE_FILES, ids=lambda p: p.name)
def test_a_recipes_own_advice_works_as_written(path):
    for overrides in _advice(header(path)):
        load_recipe(path, overrides)  # a RecipeError here: the header's advice does not work as written


def test_lora_with_a_quant_type_says_to_remove_it():
    from lorakit.errors import RecipeError

    with pytest.raises(RecipeError, match=r"remove method.quant_type \(method.quant_type=null"):
        load_recipe(RECIPES / "qwen3_30b_a3b_qlora.yaml", ["method.kind=lora"])


def test_a_hub_model_the_hub_cannot_serve_fails_at_once_naming_hf_hub_offline(monkeypatch, tmp_path):
    import time

    from huggingface_hub import constants

    from lorakit.errors import RecipeError
    from lorakit.model.source import load_config

    # No network: the hub's name does not resolve (.invalid never does), and the model is not cached.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "https://hub.invalid")
    recipe = load_recipe(
        RECIPE, ["model.name_or_path=lorakit-tests/no-such-model", f"data.cache_dir={tmp_path}"]
    )
    start = time.monotonic()
    with pytest.raises(RecipeError, match=r"the hub \(hub.invalid\) cannot be reached.*set HF_HUB_OFFLINE=1"):
        load_config(recipe)
    assert time.monotonic() - start < 10  # huggingface_hub's retries took ~30 s
