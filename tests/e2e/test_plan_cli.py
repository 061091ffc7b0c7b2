"""python -m lorakit.plan as a user types it: JSON plans, the table, exit codes 0 / 1 / 2."""

import json

import lorakit
from tests.conftest import RECIPES, run_cli


def test_json_plan_fits_and_exits_0():
    proc = run_cli(
        "lorakit.plan", RECIPES / "flan_t5_xxl_lora.yaml", "--gpus", "8", "--gpu-memory", "40GB",
        "--cpu-memory", "1100GB", "--target-len", "128", "--json", timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout)
    assert plan["fits"] is True and plan["gpus_per_node"] == 8 and plan["nodes"] == 1
    assert 0 < plan["per_gpu_bytes"] < 40 * 10**9 and plan["per_node_cpu_bytes"] > 0
    assert plan["recommended"]["fits"] is True and "overrides" in plan["recommended"]
    assert plan["gradient_checkpointing"] == {
        "mode": "whole", "every": None, "why": "model.gradient_checkpointing: true in the recipe"}  # fmt: skip
    # The same numbers as the API.
    api = lorakit.plan(
        RECIPES / "flan_t5_xxl_lora.yaml", gpus=8, gpu_memory="40GB", cpu_memory="1100GB", target_len=128
    )
    assert api.per_gpu_bytes == plan["per_gpu_bytes"] and api.per_node_cpu_bytes == plan["per_node_cpu_bytes"]


def test_table_for_a_setup_that_does_not_fit_exits_1_with_a_recommendation():
    # Full fine-tuning of XXL without checkpointing on 2 nodes of 4 GPUs, overrides applied as for lorakit.run.
    proc = run_cli(
        "lorakit.plan", RECIPES / "flan_t5_xxl_lora.yaml", "method.kind=full", "model.gradient_checkpointing=false",
        "--gpus", "4", "--nodes", "2", "--gpu-memory", "40GiB", "--target-len", "128", timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    out = proc.stdout
    assert "2 node(s) x 4 GPU(s)" in out and "DOES NOT FIT" in out
    assert "best setup that fits" in out and "run it with:" in out
    assert "  gradient checkpointing: off: model.gradient_checkpointing: false in the recipe\n" in out
    assert "Traceback" not in proc.stderr


def test_bad_input_exits_2_with_a_message():
    proc = run_cli("lorakit.plan", RECIPES / "flan_t5_xxl_lora.yaml", "--gpu-memory", "lots", timeout=300)
    assert (
        proc.returncode == 2
        and "error: --gpu-memory: expected a size" in proc.stderr
        and "Traceback" not in proc.stderr
    )
    proc = run_cli(
        "lorakit.plan", RECIPES / "flan_t5_xxl_lora.yaml", "model.name_or_path=org/not-a-known-model",
        "--gpu-memory", "40GB", timeout=300,
    )  # fmt: skip
    assert (
        proc.returncode == 2 and "does not know this model" in proc.stderr and "Traceback" not in proc.stderr
    )


def test_lorakit_plan_stays_callable_after_the_module_is_imported():
    import lorakit.plan  # noqa: F401  (rebinds the package attribute to the module)

    assert callable(lorakit.plan)
    p = lorakit.plan(RECIPES / "flan_t5_xl_lora.yaml", gpu_memory="40GB", target_len=128)
    assert p.fits is True and p.gpus == 8
