"""Contracts on routed models in every dtype: bf16 rounding of merged weights flips top-k routing at near-ties,
so the doctor's "LoRA merged == adapter" and lorakit.merge's verification compare with the routing fixed
(the adapter model's top-k choices forced on every other forward of the probe). A correct merge passes in bf16;
a wrong one (the delta scaled) still fails."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_recipe

SCALE = 4
MOE_KINDS = ("mixtral", "qwen3_moe", "olmoe")


def _built(tmp_path, kind: str, dtype: str):
    from lorakit.doctor.contracts import prepare_for_contract
    from lorakit.model import build_model

    recipe = tiny_recipe(
        tmp_path,
        tmp_path / "run",
        model={"name_or_path": f"tiny:{kind}", "attention": "sdpa", "dtype": dtype},
        data={"format": "instruction", "max_length": 128},
        method={"r": 4, "alpha": 8, "dropout": 0.0},
    )
    # A visible adapter: the contract's own B init (0.05) x SCALE, so bf16 near-ties flip some routes.
    built = prepare_for_contract(build_model(recipe), seed=0)
    with torch.no_grad():
        for name, p in built.model.named_parameters():
            if "lora_B" in name:
                p.mul_(SCALE)
    return built


def _scaled_merge(model):
    """A wrong merge: the delta applied twice over."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(2)
    return model.merge_and_unload(safe_merge=True)


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_the_merge_contract_passes_a_correct_merge_in_bf16_and_fails_a_scaled_one(tmp_path, kind):
    from lorakit.doctor import contracts

    built = _built(tmp_path, kind, "bfloat16")
    good = contracts.merge(built)
    assert good.status == "pass", good.detail
    assert "routing fixed" in good.detail
    bad = contracts.merge(built, merge_fn=_scaled_merge)
    assert bad.status == "fail", bad.detail


def test_fixed_routing_forces_the_recorded_choices_and_leaves_a_dense_model_alone():
    from lorakit.model.families import family_named
    from lorakit.model.router import fixed_routing_for
    from lorakit.testing import SPECIAL_TOKENS, TINY_VOCAB_SIZE

    tiny = family_named("mixtral").tiny
    config = tiny.config(TINY_VOCAB_SIZE, bos=SPECIAL_TOKENS.index("<s>"))
    torch.manual_seed(0)
    model = tiny.model(config).eval()
    routing = fixed_routing_for(config)
    ids = torch.randint(4, TINY_VOCAB_SIZE, (2, 16))
    # What the experts are given: the indices after every router hook.
    seen: list[torch.Tensor] = []
    experts = [m for m in model.modules() if type(m).__name__ == "MixtralExperts"]
    handles = [e.register_forward_pre_hook(lambda m, args: seen.append(args[1])) for e in experts]
    with torch.no_grad(), routing.applied(model):
        want = model(input_ids=ids).logits
    recorded = [c.clone() for c in routing.choices]
    assert all(torch.equal(s, r) for s, r in zip(seen, recorded, strict=True))
    # The routers redrawn: their own choices differ, the experts still get the recorded ones.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                torch.nn.init.normal_(p)
    seen.clear()
    with torch.no_grad(), routing.applied(model):
        got = model(input_ids=ids).logits
    for h in handles:
        h.remove()
    assert len(seen) == len(recorded) == config.num_hidden_layers
    assert all(torch.equal(s, r) for s, r in zip(seen, recorded, strict=True))
    assert not torch.equal(got, want)
    assert fixed_routing_for(type("Dense", (), {"model_type": "llama"})()) is None


def test_lorakit_merge_verifies_a_bf16_moe_merge_with_the_routing_fixed_and_refuses_a_scaled_one(
    tmp_path, monkeypatch
):
    """The same for lorakit.merge: the adapter above, saved, merges in bf16 verified (free routing would
    refuse it: a correct merge differing by flipped experts); a merge applying twice the delta is refused."""
    import lorakit
    import lorakit.export.job as job
    from lorakit.errors import VerificationError

    built = _built(tmp_path, "mixtral", "float32")
    adapter = tmp_path / "adapter"
    built.model.save_pretrained(str(adapter))
    result = lorakit.merge(adapter, tmp_path / "merged", dtype="bfloat16", strategy="memory")
    assert all(c.passed for c in result.checks) and result.checks[0].effect_visible
    with monkeypatch.context() as m:
        m.setattr(job, "fixed_routing_for", lambda config: None)
        with pytest.raises(VerificationError):
            lorakit.merge(adapter, tmp_path / "free", dtype="bfloat16", strategy="memory")
    monkeypatch.setattr(job, "_merge_weights", _scaled_merge)
    with pytest.raises(VerificationError) as e:
        lorakit.merge(adapter, tmp_path / "scaled", dtype="bfloat16", strategy="memory")
    assert e.value.exit_code == 3 and not (tmp_path / "scaled").exists()
