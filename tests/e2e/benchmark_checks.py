"""What the smoke tests and the tests of committed results assert about any result of a spec: its declared
keys, its provenance, and ratios and claims that follow from its own medians (a flag reports the recorded
measurement; whether a claim holds is never assumed)."""

from __future__ import annotations

import math

# A committed result is only valid if the code that trains did not change while it was measured.
TRAINING_PATH = ("lorakit/engine/", "lorakit/data/", "lorakit/model/", "lorakit/recipe/", "lorakit/meter.py")


def check_result(result: dict, spec: dict, repeats: int) -> None:
    """Asserts the spec's result_keys and run_keys, provenance, one torch thread count for every run, and
    that each ratio and claim is what the recorded medians say."""
    assert result["benchmark"] == spec["benchmark"]
    missing = set(spec["result_keys"]) - set(result)
    assert not missing, f"result lacks {sorted(missing)}"
    for run in result["runs"]:
        assert not set(spec["run_keys"]) - set(run), (sorted(set(spec["run_keys"]) - set(run)), run)
    assert len({r["torch_threads"] for r in result["runs"]}) == 1  # DeepSpeed may reset it; runs pin it again
    machine, versions = result["machine"], result["versions"]
    assert machine["platform"] and machine["cpu_count"] and "cpu_model" in machine
    for name in ("python", "torch", "transformers", "peft", "deepspeed", "lorakit"):
        assert versions[name], name
    key_format = spec.get("ratio_key", "{side}/{versus}")
    meds = result.get("medians", {})
    for key, r in result.get("ratios", {}).items():
        side, base = r["side"], r["versus"]
        assert key == key_format.format(side=side, versus=base)
        expected = meds[side]["useful_tokens_per_second"] / meds[base]["useful_tokens_per_second"]
        assert math.isclose(r["useful_tokens_per_second"], expected, rel_tol=1e-9, abs_tol=1e-12), key
        assert len(r["paired_useful_tokens_per_second"]) == repeats, key
    for c in result.get("claims", []):
        if c["metric"] == "eval_loss":
            assert c["claim_met"] == (c["side_eval_loss"] <= c["versus_eval_loss"]), c["name"]
            assert len(c["paired_differences"]) == repeats
        else:
            assert c["claim_met"] == (c["measured_ratio"] >= c["ratio_at_least"]), c["name"]
            if "cpu_ratio" in c:
                assert c["cpu_claim_met"] == (c["cpu_ratio"] >= c["ratio_at_least"]), c["name"]


def check_sweep(sweep: dict, items: str, per: str, chosen_by: str) -> None:
    """A sweep (`items`: its candidates' key, `per`: their summaries'): one summary per candidate, a run
    per candidate and round, and the chosen candidate the best by `chosen_by`."""
    summaries = sweep[per]
    assert set(summaries) == {str(x) for x in sweep[items]}
    assert max(summaries, key=lambda x: summaries[x][chosen_by]) == str(sweep["best"])
    assert len(sweep["runs"]) == sweep["repeats"] * len(sweep[items])


def check_committed(result: dict) -> None:
    """A committed result: lorakit's training path did not change while it was measured."""
    source = result["lorakit_source"]
    changed = source.get("changed_during_run", [])
    assert source["unchanged_during_run"] == (not changed)
    assert not [f for f in changed if f.startswith(TRAINING_PATH)], changed
