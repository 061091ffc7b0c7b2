"""benchmarks/gpu_bench.py: a CPU smoke run of the script (tiny configs, the same code as on a GPU), its result
checked against an independent count of the FLOPs it claims, the --merge mode, and the committed GPU result."""

import copy
import json
import math
import shlex

import pytest

from benchmarks.harness.cli import load_spec
from tests.e2e.benchmark_runs import RESULTS, run_script

SPEC = load_spec("gpu_bench")
COMMITTED = RESULTS / "gpu_h200.json"
# One causal workload (packed lorakit vs Trainer) and one T5 workload (full fine-tuning vs Seq2SeqTrainer).
SMOKE_WORKLOADS = ("causal_1b_lora", "t5_xl_full")
# The command docs/gpu.md shows (covered-by this test); the test adds where to write.
SMOKE_COMMAND = "python benchmarks/gpu_bench.py --smoke"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    base = tmp_path_factory.mktemp("gpu-bench")
    output, out_dir = base / "smoke.json", base / "out"
    assert SPEC["smoke"][SPEC["smoke"].index("--workloads") + 1] == ",".join(SMOKE_WORKLOADS)
    args = shlex.split(SMOKE_COMMAND)[2:]
    proc = run_script("gpu_bench", *args, "--output", output, "--out", out_dir, "--work-dir", base / "work")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(output.read_text()), output, out_dir, proc.stdout


def linear_params(cfg: dict, r: int) -> tuple[dict, dict]:
    """Matmul and LoRA parameters per token of each stream, from the saved config alone (no model)."""
    if cfg["model_type"] == "t5":
        d, inner, ff, vocab = cfg["d_model"], cfg["num_heads"] * cfg["d_kv"], cfg["d_ff"], cfg["vocab_size"]
        attn, gated = [(d, inner)] * 3 + [(inner, d)], [(d, ff), (d, ff), (ff, d)]
        encoder = cfg["num_layers"] * (attn + gated)
        cross_kv = cfg["num_decoder_layers"] * [(d, inner)] * 2
        decoder = cfg["num_decoder_layers"] * (attn + [(d, inner), (inner, d)] + gated)
        streams = {"source": encoder + cross_kv, "target": decoder}
    else:
        h, hd, ff, vocab = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"]
        q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
        layer = [(h, q), (h, kv), (h, kv), (q, h), (h, ff), (h, ff), (ff, h)]
        streams = {"token": cfg["num_hidden_layers"] * layer}
    head_stream = "target" if "target" in streams else "token"
    params = {k: sum(i * o for i, o in v) for k, v in streams.items()}
    lora = {k: sum(r * (i + o) for i, o in v) for k, v in streams.items()}
    params[head_stream] += (cfg["d_model"] if cfg["model_type"] == "t5" else cfg["hidden_size"]) * vocab
    return params, lora


def expected_flops(w: dict, sums: dict) -> float:
    """The stated accounting, written again: 6N (full) or 4N + 6 N_lora (LoRA) per token, 12 h d per pair."""
    cfg, acc = w["model_config"], w["accounting"]
    params, lora = linear_params(cfg, acc["lora_r"])
    full = w["method"] == "full"

    def per_token(stream):
        return 6 * params[stream] if full else 4 * params[stream] + 6 * lora[stream]

    if cfg["model_type"] == "t5":
        pair = 12 * cfg["num_heads"] * cfg["d_kv"]
        return (
            per_token("source") * sums["source_tokens"]
            + per_token("target") * sums["target_tokens"]
            + pair * cfg["num_layers"] * sums["encoder_pairs"]
            + pair * cfg["num_decoder_layers"] * (sums["decoder_pairs"] + sums["cross_pairs"])
        )
    pair = 12 * cfg["num_attention_heads"] * cfg["head_dim"]
    return per_token("token") * sums["tokens"] + pair * cfg["num_hidden_layers"] * sums["pairs"]


def expected_flops_nemo(w: dict, sums: dict) -> float:
    """NeMo's LoRA count written again: the full fine-tuning FLOPs x (2 + lora/frozen)/3."""
    if w["method"] == "full":
        return expected_flops(w, sums)
    params, lora = linear_params(w["model_config"], w["accounting"]["lora_r"])
    streams = (
        [("source", "source_tokens"), ("target", "target_tokens")]
        if "source" in params
        else [("token", "tokens")]
    )
    frozen = sum(params[s] * sums[k] for s, k in streams)
    adapters = sum(lora[s] * sums[k] for s, k in streams)
    attention = expected_flops(w, sums) - 4 * frozen - 6 * adapters
    return (6 * frozen + attention) * (2 + adapters / frozen) / 3


def check_result(result: dict, smoke: bool) -> None:
    assert result["benchmark"] == "gpu_bench" and result["smoke"] is smoke
    assert "6N" in result["flop_accounting"] and "4N" in result["flop_accounting"]
    for name in ("torch", "transformers", "peft", "deepspeed", "accelerate", "python"):
        assert result["versions"][name], name
    peak = result["peak_flops"]
    assert peak["measured_matmul"] > 0
    if smoke:
        assert peak["datasheet"] is None  # a CPU: no MFU against a datasheet, only against the measured rate
    else:
        assert peak["datasheet"] > 0 and result["device"]["gpu_name"] and result["device"]["nvidia_smi"]
    assert result["workloads"]
    for name, w in result["workloads"].items():
        if w["status"] == "skipped":
            assert w["reason"], name
            continue
        assert w["status"] == "measured", (name, w.get("error"))
        assert w["checks"]["equal_on_all_sides"] is True and w["checks"]["finite_losses"] is True
        # The accounting the FLOPs rest on matches an independent count from the saved config.
        params, lora = linear_params(w["model_config"], w["accounting"]["lora_r"])
        assert w["accounting"]["matmul_params_per_token"] == params
        assert w["accounting"]["lora_params_per_token"] == lora
        sides = w["sides"]
        assert "lorakit" in sides and "hf" in sides
        for side, r in sides.items():
            assert r["status"] == "measured", (name, side)
            check_side(w, r, peak, smoke)
        for key, ratio in w["ratios"].items():
            side, base = key.split("/")
            expected = sides[side]["useful_tokens_per_second"] / sides[base]["useful_tokens_per_second"]
            assert ratio == pytest.approx(expected)
        assert "lorakit/hf" in w["ratios"]
    for target in result["targets"].values():
        if "within" in target:  # a measured/planned ratio
            assert target["met"] is None or target["met"] == (abs(target["measured"] - 1) <= target["within"])
        else:
            assert target["met"] is None or target["met"] == (target["measured"] >= target["at_least"])


def check_side(w: dict, r: dict, peak: dict, smoke: bool, matmul_rates: tuple = ()) -> None:
    """One measured side: its rates, FLOPs (recounted from the saved config) and MFU as the accounting says.
    `matmul_rates`: the measured matmul rates of a merged result's calls (each side uses its own call's)."""
    sums, seconds = r["timed_sums"], r["timed_seconds"]
    assert r["timed_steps"] >= 1 and seconds > 0 and sums["examples"] > 0
    assert r["useful_tokens_per_second"] > 0
    assert r["useful_tokens_per_second"] == pytest.approx(r["useful_tokens_timed"] / seconds)
    flops = expected_flops(w, sums)
    assert r["model_flops_timed"] == pytest.approx(flops, rel=1e-12)
    rates = matmul_rates or (peak["measured_matmul"],)
    assert any(r["mfu_vs_measured_matmul"] == pytest.approx(flops / seconds / m, rel=1e-4) for m in rates)
    if peak["datasheet"]:
        assert r["mfu"] == pytest.approx(flops / seconds / peak["datasheet"]) and 0 < r["mfu"] < 1
    else:
        assert r["mfu"] is None
    if "model_flops_nemo_timed" in r:  # results written before issue 61 lack NeMo's count
        assert r["model_flops_nemo_timed"] == pytest.approx(expected_flops_nemo(w, sums), rel=1e-12)
    assert 0 < r["padding_efficiency_timed"] <= 1
    if not smoke:
        assert r["peak_gpu_memory_bytes"] > 0


def test_smoke_run_result(smoke):
    result, output, out_dir, stdout = smoke
    check_result(result, smoke=True)
    assert set(result["workloads"]) == set(SMOKE_WORKLOADS)
    causal = result["workloads"]["causal_1b_lora"]
    assert causal["sides"]["lorakit"]["batching"]["packing"] is True
    assert causal["sides"]["lorakit"]["attention"] == "lorakit_varlen_sdpa"
    # Packed rows waste less than random padded batches of the same examples.
    assert (
        causal["sides"]["lorakit"]["padding_efficiency_timed"]
        > causal["sides"]["hf"]["padding_efficiency_timed"]
    )
    # The spec profiles one warm-up step of this workload: on a CPU, its operators by their own time.
    profile = causal["sides"]["lorakit"]["profile"]
    assert profile["what"] == "CPU operators" and profile["step"] == result["warmup_steps"] - 1
    assert profile["top"] and all(k["ms"] >= 0 and 0 <= k["share"] <= 1 for k in profile["top"])
    assert sum(k["share"] for k in profile["top"]) <= 1 + 1e-9 and "profile" not in causal["sides"]["hf"]
    # Every lorakit side is set against lorakit.plan of the recipe it trained.
    for w in result["workloads"].values():
        plan = w["sides"]["lorakit"]["plan"]
        assert plan["planned_allocated_bytes"] > 0, plan
        assert plan["ratio"] == pytest.approx(plan["measured_peak_bytes"] / plan["planned_allocated_bytes"])
    t5 = result["workloads"]["t5_xl_full"]
    assert t5["sides"]["lorakit"]["trainable_params"] == t5["sides"]["lorakit"]["total_params"]
    # The same rows trained on both sides, one epoch each.
    assert len({r["useful_tokens_epoch"] for r in t5["sides"].values()}) == 1
    assert "useful tok/s" in stdout and f"wrote {output}" in stdout


def test_smoke_writes_into_out_dir(smoke):
    _, output, out_dir, _ = smoke
    assert json.loads((out_dir / output.name).read_text()) == json.loads(output.read_text())
    assert (out_dir / output.with_suffix(".png").name).stat().st_size > 0
    log = (out_dir / output.with_suffix(".log").name).read_text()
    assert "===== causal_1b_lora-lorakit (lorakit)" in log and "===== t5_xl_full-hf (hf)" in log


def test_merge_combines_parts(smoke, tmp_path):
    result, *_ = smoke
    parts = []
    for i, name in enumerate(SMOKE_WORKLOADS):
        part = copy.deepcopy(result)
        part["workloads"] = {name: result["workloads"][name]}
        part["command"] = f"part {i}"
        path = tmp_path / f"part{i}.json"
        path.write_text(json.dumps(part))
        parts.append(path)
    merged_path = tmp_path / "merged.json"
    proc = run_script("gpu_bench", "--merge", *parts, "--output", merged_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    merged = json.loads(merged_path.read_text())
    assert set(merged["workloads"]) == set(SMOKE_WORKLOADS)
    assert [p["workloads"] for p in merged["parts"]] == [[n] for n in SMOKE_WORKLOADS]
    check_result(merged, smoke=True)
    assert merged_path.with_suffix(".png").is_file()


def test_committed_gpu_result():
    """The committed H200 result, once a GPU run has produced it (benchmarks/gpu_lease_plan.md)."""
    if not COMMITTED.is_file():
        pytest.skip("no committed GPU result yet: see benchmarks/gpu_lease_plan.md")
    result = json.loads(COMMITTED.read_text())
    check_result(result, smoke=False)
    assert "H200" in result["peak_flops"]["device"]
    assert set(result["workloads"]) >= {"causal_1b_lora", "t5_xl_lora"}
    headline = result["targets"]["packed_causal_lora_vs_hf"]
    assert headline["measured"] is not None and math.isfinite(headline["measured"])


def test_committed_first_lease_result():
    """The first lease's headline workload (benchmarks/results/gpu_h200_2026-11-26.md): measured on an H200,
    every side on the same tokens, and the ratio the README states recomputed from the sides."""
    result = json.loads((RESULTS / "gpu_h200_causal_1b_lora.json").read_text())
    check_result(result, smoke=False)
    assert "H200" in result["peak_flops"]["device"] and result["versions"]["torch"].startswith("2.11")
    sides = result["workloads"]["causal_1b_lora"]["sides"]
    ratio = sides["lorakit"]["useful_tokens_per_second"] / sides["hf"]["useful_tokens_per_second"]
    headline = result["targets"]["packed_causal_lora_vs_hf"]
    assert math.isclose(headline["measured"], ratio) and headline["met"] is (ratio >= 1.5)
    assert round(ratio, 2) == 3.12  # the number benchmarks/README.md quotes


GPU_TEST = """
import pytest

pytestmark = pytest.mark.gpu


def test_on_the_gpu():
    {body}
"""
BODIES = {
    "skipped": 'pytest.skip("needs a CUDA GPU")',  # what every test in tests/gpu does on a CPU
    "failing": "assert False",
    "passing": "assert True",
}


@pytest.mark.parametrize("outcome, passed", [("skipped", False), ("failing", False), ("passing", True)])
def test_gpu_test_outcome_sets_the_exit_status(tmp_path, outcome, passed):
    """--run-gpu-tests: the script exits 1 unless the GPU tests ran and passed (all skipped is not a pass)."""
    from benchmarks.harness.device import run_gpu_tests
    from benchmarks.harness.gpu_result import exit_status

    path = tmp_path / "test_gpu_outcome.py"
    path.write_text(GPU_TEST.format(body=BODIES[outcome]))
    gpu_tests = run_gpu_tests(tmp_path / "log.txt", [].append, tests=str(path))
    assert gpu_tests["passed"] is passed, gpu_tests
    assert gpu_tests["exit_code"] == (1 if outcome == "failing" else 0)
    assert {"skipped": "1 skipped", "failing": "1 failed", "passing": "1 passed"}[outcome] in gpu_tests[
        "summary"
    ]
    measured = {"workloads": {"causal_1b_lora": {"status": "measured"}}}
    assert exit_status(measured) == 0  # not asked for: the workloads decide
    assert exit_status({**measured, "gpu_tests": gpu_tests}) == (0 if passed else 1)


def test_committed_third_lease_result():
    """The third lease (benchmarks/results/gpu_h100_2026-11-27.md): every measured side recounted as the
    accounting says, the GPU tests passed, and the numbers the docs quote recomputed from the sides."""
    result = json.loads((RESULTS / "gpu_h100_2026-11-27.json").read_text())
    peak, workloads = result["peak_flops"], result["workloads"]
    assert "H100" in peak["device"] and result["versions"]["torch"].startswith("2.11")
    assert result["gpu_tests"]["passed"] is True and "24 passed" in result["gpu_tests"]["summary"]
    measured_sides = 0
    for name, w in workloads.items():
        for side, r in w["sides"].items():
            if r["status"] != "measured":
                assert r["status"] in ("skipped", "failed") and (r.get("reason") or r.get("error")), (
                    name,
                    side,
                )
                continue
            measured_sides += 1
            # Call 1 measured 738.33 TFLOP/s, call 2 (8B QLoRA) 777.27 (the .md).
            check_side(w, r, peak, smoke=False, matmul_rates=(738.33e12, 777.27e12))
            assert r["loss_last"] < r["loss_first"], (name, side)
            if side.startswith("lorakit"):
                plan = r["plan"]
                assert plan["ratio"] == pytest.approx(
                    r["peak_gpu_memory_bytes"] / plan["planned_allocated_bytes"]
                )
                assert 0.9 < plan["ratio"] < 1.1, (name, plan["ratio"])  # "within 7%" in the docs
    assert measured_sides == 6
    targets = result["targets"]
    xxl = workloads["t5_xxl_lora"]["sides"]["lorakit"]
    assert targets["t5_xxl_lora_plan"]["met"] is True and round(xxl["plan"]["ratio"], 2) == 1.01
    assert round(xxl["peak_gpu_memory_bytes"] / 2**30, 1) == 25.1
    mfu_8b = workloads["causal_8b_lora_4k_nockpt"]["sides"]["lorakit"]["mfu"]
    assert targets["causal_8b_lora_mfu"]["met"] is False and round(mfu_8b, 3) == 0.232
    t5 = workloads["t5_xl_lora"]["sides"]
    ratio = t5["lorakit"]["useful_tokens_per_second"] / t5["hf"]["useful_tokens_per_second"]
    assert targets["t5_xl_lora_vs_hf"]["measured"] == pytest.approx(ratio) and round(ratio, 2) == 1.29
    # The profiles the docs describe: device kernels, with the T5 step's host syncs counted.
    profile = t5["lorakit"]["profile"]
    assert profile["what"] == "device kernels" and profile["top"] and profile["kernel_launches"] > 0
    syncs = {h["name"]: h["calls"] for h in profile["host_top"]}
    assert syncs["cudaStreamSynchronize"] == 879
