"""Token-weighted loss: micro-batches, ranks with different token counts and the sharding backend (DeepSpeed
ZeRO-3, FSDP2 full and hybrid) must not change the step; nor do two ZeRO-3 ranks for the dense families of
issue 45 and the MoE families with skewed routing. The same engines generate as the whole model does
(Engine.generate).

The one-process steps run in this process; every two-rank step (token_weighting_worker.py,
dense_families_worker.py, moe_worker.py) in one 2-process launch (two_ranks_worker.py), FSDP2 hybrid
sharding in one 4-process launch. Every step is a check of its own (worker_checks.py) and every comparison a
test of its own: a step that fails fails the tests that read it, and no other."""

import json
import subprocess
from pathlib import Path

import pytest
import torch

from lorakit.engine.launch import torchrun_command
from lorakit.model.loss import micro_batch_loss, token_loss_sum
from tests.integration import dense_families_worker, moe_worker, token_weighting_worker
from tests.integration.worker_checks import check_ran

ROOT = Path(__file__).resolve().parents[2]
MODES = ("fsdp", "fsdp-window4", "fsdp-each4")


def test_micro_batch_scaling_matches_one_batch_gradient():
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 11)
    x = torch.randn(7, 5, 6)
    labels = torch.randint(0, 11, (7, 5))
    labels[:2, 1:] = -100  # the first micro-batch has far fewer target tokens
    total = float((labels != -100).sum())

    lin.zero_grad()
    token_loss_sum(lin(x), labels).div(total).backward()
    want = lin.weight.grad.clone()

    lin.zero_grad()
    for sl in (slice(0, 2), slice(2, 7)):
        micro_batch_loss(token_loss_sum(lin(x[sl]), labels[sl]), total, world_size=1).backward()
    torch.testing.assert_close(lin.weight.grad, want)

    # The mean of per-micro-batch means (what a naive loop does) is a different gradient.
    lin.zero_grad()
    for sl in (slice(0, 2), slice(2, 7)):
        n = float((labels[sl] != -100).sum())
        (token_loss_sum(lin(x[sl]), labels[sl]) / n / 2).backward()
    assert not torch.allclose(lin.weight.grad, want, atol=1e-4)


def _run(cmd, cwd):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def _launch(cmd, cwd) -> str:
    """The launch's output; its exit code is left to the checks (a step that raised exits 0 from its worker)."""
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900)
    return f"exit code {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-5000:]}"


def _check_same_step(steps: dict, folder: str, name: str, ref: str) -> None:
    out = steps[folder]
    for n in (name, ref):
        check_ran(out, n, steps["launches"])
    stats = {n: json.loads((out / f"{n}.json").read_text()) for n in (name, ref)}
    weights = {n: torch.load(out / f"{n}.pt") for n in (name, ref)}
    assert stats[ref]["loss"] > 0
    assert stats[name]["target_tokens"] == stats[ref]["target_tokens"]
    assert stats[name]["loss"] == pytest.approx(stats[ref]["loss"], rel=1e-5), name
    assert stats[name]["grad_norm"] == pytest.approx(stats[ref]["grad_norm"], rel=1e-4), name
    assert weights[name].keys() == weights[ref].keys()
    for key, w in weights[ref].items():
        # Whole tensors from every rank (a rank's shard has half the rows), updated by -gradient.
        assert weights[name][key].shape == w.shape, f"{name}: {key}"
        torch.testing.assert_close(weights[name][key], w, rtol=1e-4, atol=1e-7, msg=f"{name}: {key}")


@pytest.fixture(scope="module")
def steps(cache_dir, tmp_path_factory) -> dict:
    """Each worker's outputs in a folder of its own ("weighting", "dense" and "moe"), and "launches": the
    output of the two launches, for a test whose step never ran."""
    out = {name: tmp_path_factory.mktemp(name) for name in ("weighting", "dense", "moe")}
    # The one-process runs in this process (private one-process groups), saving interpreter starts.
    token_weighting_worker.main(str(cache_dir), str(out["weighting"]), "single")
    dense_families_worker.main(str(cache_dir), str(out["dense"]), "single")
    moe_worker.main(str(cache_dir), str(out["moe"]), "accumulate")
    folders = [str(out[name]) for name in ("weighting", "dense", "moe")]
    launches = _launch(
        torchrun_command(2, "tests.integration.two_ranks_worker", [str(cache_dir), *folders]), ROOT
    )
    cmd = torchrun_command(
        4, "tests.integration.token_weighting_worker", [str(cache_dir), str(out["weighting"]), "hybrid"]
    )
    launches += "\n" + _launch(cmd, ROOT)
    return {**out, "launches": launches}


KINDS = tuple(token_weighting_worker.MODELS)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["accumulate", "two_ranks", "fsdp", "hybrid"])
@pytest.mark.parametrize("kind", KINDS)
def test_one_step_is_the_same_as_one_batch_on_one_process(steps, kind, mode):
    """For the tiny T5 and the tiny Llama with LoRA (fp32, SGD at lr 1: the update is the gradient): one
    batch on one process, and two accumulated micro-batches, DeepSpeed ZeRO-3 and FSDP2 full sharding on two
    processes, FSDP2 hybrid sharding on four (2 x 2 mesh) give the same loss, gradient norm and LoRA update,
    the ranks holding different numbers of target tokens."""
    _check_same_step(steps, "weighting", f"{kind}-{mode}", f"{kind}-one_batch")


@pytest.mark.slow
def test_engine_generate_equals_the_unsharded_models_generate_on_zero3_and_fsdp(steps, cache_dir, tmp_path):
    """Engine.generate with the weights each engine holds (ZeRO-3 on one process, ZeRO-3 and FSDP2 on two,
    gathered whole for the call and layer by layer; the two ranks with different prompts and lengths) gives
    what transformers' generate gives on the whole model, greedy and sampled from the same seed, for the
    tiny Llama and the tiny T5; the ZeRO-3 and FSDP2 steps after it are test_one_step_is_the_same_as_one_
    batch_on_one_process's (DeepSpeed's per-layer hooks, FSDP2's resharding are back after a gathered
    generation)."""
    out = steps["weighting"]
    for kind in ("t5", "llama"):
        want = token_weighting_worker.reference_generations(str(cache_dir), str(tmp_path), kind)
        for rank, (rows, new) in enumerate(token_weighting_worker.GENERATE):
            ref = want[rank]
            prompt = 0 if kind == "t5" else len(ref["greedy"][0]) - new
            # Every row made exactly its new tokens (T5: after the decoder's start token).
            assert [len(r) for r in ref["greedy"]] == [prompt + new + (kind == "t5")] * len(rows)
            assert ref["sampled"] != ref["greedy"], kind
            # Whose weights are whole while generating: one process's; ZeRO-3's and FSDP2's gathered once per
            # generate (distributed.gather_for_generation auto, plenty of memory here) or not (false).
            held = {"one_batch": True, "two_ranks": True, "two_ranks-layered": False}
            held.update({"fsdp": True, "fsdp-layered": False})
            for mode, whole in held.items():
                got = json.loads((out / f"{kind}-{mode}-generate-rank{rank}.json").read_text())
                assert got.pop("whole") is whole, f"{kind} {mode} rank {rank}"
                assert got == ref, f"{kind} {mode} rank {rank}"


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_fsdp_steps_as_zero3(steps, kind):
    """FSDP2 against ZeRO-3 directly, not only through the one-process reference."""
    _check_same_step(steps, "weighting", f"{kind}-fsdp", f"{kind}-two_ranks")


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_fsdp_accumulation_reduces_once_per_step(steps, kind):
    """Gradient accumulation on FSDP2: 4 micro-batches reduced once at the boundary give the step that
    reducing after each micro-batch gives, with a quarter of the reduce-scatters: one per sharded group per
    step, as many as a step of one micro-batch."""
    _check_same_step(steps, "weighting", f"{kind}-fsdp-window4", f"{kind}-fsdp-each4")
    out = steps["weighting"]
    check_ran(out, f"{kind}-fsdp", steps["launches"])
    counts = {m: json.loads((out / f"{kind}-{m}.json").read_text())["reduce_scatters"] for m in MODES}
    assert counts["fsdp-each4"] == 4 * counts["fsdp-window4"]
    assert counts["fsdp-window4"] == counts["fsdp"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", dense_families_worker.KINDS)
def test_zero3_on_two_ranks_steps_as_one_process_for_each_dense_family(steps, kind):
    """ZeRO-3 on two processes takes the same LoRA step as one process for every dense family of issue 45
    besides the Llama-style ones above (dense_families_worker.KINDS: Gemma 2's tied head, soft-capping on
    eager and alternating windows; Phi-3's fused projections; Qwen3's and OLMo 2's q/k norms; Gemma 3 text;
    the encoder-decoder T5Gemma), the ranks holding different numbers of target tokens."""
    _check_same_step(steps, "dense", f"{kind}-two_ranks", f"{kind}-single")


@pytest.mark.slow
@pytest.mark.parametrize("kind", moe_worker.KINDS)
def test_a_zero3_step_with_skewed_routing_equals_one_process_and_moves_the_router(steps, kind):
    """Mixture of experts on 2 CPU processes (docs/moe.md#zero-3): a ZeRO-3 step with deliberately skewed
    routing (one rank's tokens reach two experts, the other's the rest; their aux losses differ) equals the
    same window accumulated on one process: loss, gradient norm, the token-weighted load-balancing loss and
    every adapter weight, the experts' (a rank's unreached experts get zero rows of gradient) and the
    router's, which the step moved (method.train_router)."""
    out = steps["moe"]
    for mode in ("accumulate", "two_ranks"):
        check_ran(out, f"{kind}-{mode}", steps["launches"])
    one, two = (json.loads((out / f"{kind}-{m}.json").read_text()) for m in ("accumulate", "two_ranks"))
    assert one["metrics"]["aux_loss"] > 0
    for key in ("loss", "grad_norm"):
        assert two[key] == pytest.approx(one[key], rel=1e-4), key
    assert two["metrics"]["aux_loss"] == pytest.approx(one["metrics"]["aux_loss"], rel=1e-4)
    weights = {m: torch.load(out / f"{kind}-{m}.pt") for m in ("accumulate", "two_ranks")}
    start = torch.load(out / f"{kind}-accumulate-start.pt")
    router = [k for k in weights["accumulate"] if ".mlp.gate." in k]
    assert router and any(".experts." in k for k in weights["accumulate"])
    for key in router:  # the router's adapter trained: lora_B (non-zero from _same_start) and lora_A moved
        assert not torch.equal(weights["accumulate"][key], start[key]), key
    for key, w in weights["accumulate"].items():
        torch.testing.assert_close(weights["two_ranks"][key], w, rtol=1e-4, atol=1e-6, msg=key)
