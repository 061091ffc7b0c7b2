"""benchmarks/gpu_checks.sh (issue 61): runnable, and its default order measures 8B LoRA and T5-XL LoRA (both
sides) first, then the A/B switches of the new paths inside the same window; the profile counts host syncs."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import torch

from benchmarks.harness import load_spec
from benchmarks.harness.gpu_result import describe_extras, profile_summary

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_checks.sh"


def default_workloads() -> list[str]:
    text = SCRIPT.read_text()
    return re.search(r'WORKLOADS="\$\{3:-([^}]+)\}"', text).group(1).split(",")


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_first_five_minutes_are_8b_and_t5_xl_then_their_ab_switches():
    spec = load_spec("gpu_bench")
    names = default_workloads()
    assert all(n in spec["workloads"] for n in names), names
    assert names[:2] == ["causal_8b_lora_4k_nockpt", "t5_xl_lora"]
    # The two headline workloads fit the first window's ~200 s after start-up, wheels and builds.
    assert sum(spec["workloads"][n]["est_seconds"] for n in names[:2]) <= 210
    assert spec["workloads"]["causal_8b_lora_4k_nockpt"].get("profile")
    assert spec["workloads"]["t5_xl_lora"].get("profile") and "hf" in spec["workloads"]["t5_xl_lora"]["sides"]
    # Each A/B variant runs right after the headlines, the same model and shape with one switch changed.
    variants = [n for n in names if spec["workloads"][n].get("ab_of")]
    assert variants and names[2 : 2 + len(variants)] == variants
    for n in variants:
        base = spec["workloads"][spec["workloads"][n]["ab_of"]]
        w = spec["workloads"][n]
        assert w["model"] == base["model"] and w["batch"] == base["batch"]
        # It changes one setting: a recipe field, or a switch the worker reads from its environment.
        assert (set(w.get("recipe", {})) - set(base.get("recipe", {}))) or w.get("env"), n


def test_profile_counts_host_syncs_on_cpu():
    x = torch.ones(8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            float((x * 2).sum())  # three reads of a value: on a GPU, three syncs
    out = profile_summary(prof, step=4, seconds=0.5)
    assert out["host_syncs"] == 3 and out["device_busy_share"] is None
    text = describe_extras({"profile": out})
    assert "3 host syncs" in text[0]
