"""GRPO's rollout step source (lorakit.objectives.grpo_rollouts) on a tiny causal LM with a LoRA adapter:
completions sampled from the current weights with the source's own generator, masked after their EOS,
advantages within each group, old and reference log-probabilities; several passes per rollout batch; resumed
from a mid-run position and rank_state (in-process) it makes exactly the windows of the uninterrupted run,
the policy trained between windows by the GRPO loss."""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader

from lorakit.data.prompts import PromptCollator
from lorakit.data.sampler import ResumableBatchSampler
from lorakit.evaluation.generate import generate_ids
from lorakit.objectives.grpo_loss import completion_log_probs, policy_loss, rollout_log_probs
from lorakit.objectives.grpo_rollouts import DONE, PASS, RolloutSteps, completion_mask
from lorakit.objectives.grpo_settings import GrpoSection
from lorakit.objectives.rewards import build_rewards
from lorakit.testing import build_tiny_model, build_tiny_tokenizer


class _Batches:
    """Prompt micro-batches in an order fixed by (seed, epoch), as the run's samplers are."""

    def __init__(self, n: int, size: int):
        self.n, self.size, self.epoch = n, size, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return -(-self.n // self.size)

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(100 + self.epoch)).tolist()
        return iter([order[i : i + self.size] for i in range(0, self.n, self.size)])


class _Engine:
    """What the source asks of an Engine: its device, forward and generate (Engine.generate's body)."""

    def __init__(self, module):
        self.module, self.device = module, torch.device("cpu")

    def __call__(self, **kw):
        return self.module(**kw)

    def generate(self, input_ids, attention_mask, **sampling):
        return generate_ids(self.module, input_ids, attention_mask, **sampling)

    def disable_adapter(self):
        return self.module.disable_adapter()


def _setup(tmp_path, **grpo):
    tok = build_tiny_tokenizer(tmp_path / "tok", kind="llama")
    torch.manual_seed(0)
    base = build_tiny_model("llama", tmp_path / "model")
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False
    )
    return _source(get_peft_model(base, config), tok, target=2, **grpo)


def _source(model, tok, *, target: int, **grpo):
    """(model, engine, source, settings): 8 prompts in micro-batches of 2, windows of 2, G = 4, up to 6 new
    tokens, the length reward at `target`; prompts left-padded for a causal LM, right-padded for an
    encoder-decoder."""
    texts = [f"Count to {n}:" for n in range(8)]
    rows = [{"prompt_ids": tok(t)["input_ids"], "prompt": t, "answer": str(i)} for i, t in enumerate(texts)]
    left = not model.config.is_encoder_decoder
    loader = DataLoader(
        rows,
        batch_sampler=ResumableBatchSampler(_Batches(len(rows), 2)),
        collate_fn=PromptCollator(tok.pad_token_id, left),
    )
    length = {"name": "length", "target": target}
    settings = GrpoSection(**({"num_generations": 4, "max_new_tokens": 6, "rewards": [length]} | grpo))
    engine = _Engine(model)
    source = RolloutSteps(
        loader, engine, settings, build_rewards(settings.rewards), tok, accumulation=2, seed=7
    )
    return model, engine, source, settings


def _train_on(model, engine, window, settings, optimizer, inputs=None) -> None:
    """One optimiser step of the GRPO loss over a window (dapo: token-weighted over the window)."""
    tokens = sum(int(b["completion_mask"].sum()) for b in window)
    optimizer.zero_grad()
    for b in window:
        logp = rollout_log_probs(engine, b, None, inputs)
        parts = policy_loss(
            logp,
            b["old_logp"] if settings.passes > 1 else logp.detach(),  # as GrpoObjective.loss
            b["advantages"],
            b["completion_mask"],
            aggregation=settings.loss,
            epsilon=settings.epsilon,
            beta=settings.beta,
            ref_logp=b.get("ref_logp"),
            max_new_tokens=settings.max_new_tokens,
            num_tokens=tokens,
        )
        parts.loss.backward()
    optimizer.step()


def _optimizer(model):
    return torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)


def test_completion_mask_ends_at_the_first_eos():
    c = torch.tensor([[5, 6, 2, 0, 0], [5, 2, 2, 7, 2], [5, 6, 7, 8, 9]])
    assert completion_mask(c, 2).tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]


def test_windows_hold_scored_groups_and_repeat_for_each_pass(tmp_path):
    model, engine, source, settings = _setup(tmp_path, passes=2, beta=0.1)
    assert source.plan(1, None).steps_per_epoch == 4  # 4 prompt batches / accumulation 2, x 2 passes
    windows = list(source.windows(0, {}))
    assert [w.position for w in windows] == [
        {DONE: 0, PASS: 1},
        {DONE: 2, PASS: 0},
        {DONE: 2, PASS: 1},
        {DONE: 4, PASS: 0},
    ]
    assert [w.last for w in windows] == [False, False, False, True]
    assert windows[0].batches is windows[1].batches  # the second pass trains the same rollouts
    b = windows[0].batches[0]
    assert b["input_ids"].shape[0] == 8 and b["advantages"].view(2, 4).sum(1).abs().max() < 1e-4
    lengths = b["completion_mask"].sum(1).float()
    assert torch.allclose(b["rewards"], (1 - (lengths - 2).abs() / 2).clamp(min=0))
    assert torch.allclose(b["reward_parts"]["length"], b["rewards"])
    with torch.no_grad():
        now = completion_log_probs(engine, b["input_ids"], b["attention_mask"], int(b["prompt_width"]))
    assert torch.allclose(now, b["old_logp"], atol=1e-5)  # nothing trained yet: old = current
    assert not torch.allclose(b["ref_logp"], b["old_logp"], atol=1e-3)  # the adapter was off


def _run(setup, epochs=2, stop_after=None, resume=None, windows=None):
    """Train the source `setup()` makes for `epochs`, one optimiser step a window: the rollouts of every
    window (their tokens), and after `stop_after` steps what a checkpoint keeps (rank_state, LoRA weights,
    optimiser state, epoch, position), which `resume` hands back; `windows`: stop after that many."""
    model, engine, source, settings = setup()
    optimizer = _optimizer(model)
    epoch, position = 0, {}
    if resume is not None:
        rank_state, weights, opt, epoch, position = resume
        model.load_state_dict(weights, strict=False)
        optimizer.load_state_dict(opt)
        source.load_rank_state(rank_state)
    seen, step = [], 0
    for e in range(epoch, epochs):
        for w in source.windows(e, position if e == epoch else {}):
            seen.append(torch.cat([b["input_ids"].flatten() for b in w.batches] + [
                b["completions"].flatten() for b in w.batches if "completions" in b]))  # fmt: skip
            _train_on(model, engine, w.batches, settings, optimizer, source.packed_inputs)
            step += 1
            if len(seen) == windows:
                return seen, None
            if step == stop_after:
                trainable = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
                return seen, (
                    source.rank_state(),
                    trainable,
                    copy.deepcopy(optimizer.state_dict()),
                    e,
                    w.position,
                )
    return seen, None


def test_a_run_resumed_mid_window_makes_the_uninterrupted_runs_windows(tmp_path):
    whole, _ = _run(lambda: _setup(tmp_path / "whole", passes=2))
    # Step 5 ends the first pass of epoch 1's first window: the rollouts' second pass comes from rank_state.
    first, saved = _run(lambda: _setup(tmp_path / "a", passes=2), stop_after=5)
    assert saved[-1] == {DONE: 0, PASS: 1} and any(k.startswith("pending.") for k in saved[0])
    rest, _ = _run(lambda: _setup(tmp_path / "b", passes=2), resume=saved)
    assert len(first) + len(rest) == len(whole) == 8
    for got, want in zip(first + rest, whole, strict=True):
        assert torch.equal(got, want)
    # Without the rank_state the pending window is sampled again, from weights that moved since (sampling is
    # seeded by the micro-batch's place): other rollouts, so the check above can fail.
    other, _ = _run(lambda: _setup(tmp_path / "c", passes=2), resume=({}, *saved[1:]))
    assert not all(torch.equal(g, w) for g, w in zip(other, whole[5:], strict=True))


class _Counting(_Engine):
    """An _Engine that counts its forwards (generate calls the module itself, so only scoring counts)."""

    forwards = 0

    def __call__(self, **kw):
        self.forwards += 1
        return super().__call__(**kw)


def test_one_pass_skips_the_old_forward_and_trains_as_if_it_ran(tmp_path):
    from lorakit.objectives.grpo import GrpoObjective

    counts = {}
    for passes in (2, 1):
        model, _, source, settings = _setup(tmp_path / str(passes), passes=passes, beta=0.1)
        source.engine = source.generation = engine = _Counting(model)
        window = next(iter(source.windows(0, {})))
        # Per micro-batch of rollouts: the reference's forward, and the old policy's only with 2 passes.
        counts[passes] = engine.forwards / len(window.batches)
    b = window.batches[0]
    assert counts == {2: 2, 1: 1} and "old_logp" not in b and len(window.batches) == 2
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    for aggregation in ("grpo", "dapo", "dr_grpo"):
        s = settings.model_copy(update={"loss": aggregation})
        model.zero_grad()
        skipped, _ = GrpoObjective(s).loss(engine, None, b, torch.device("cpu"))
        skipped.backward()
        got = [p.grad.clone() for p in lora]
        # The unskipped computation: the old log-probabilities from their own no-grad forward.
        model.zero_grad()
        with torch.no_grad():
            old = rollout_log_probs(engine, b)
        logp = rollout_log_probs(engine, b)
        full = policy_loss(
            logp, old, b["advantages"], b["completion_mask"], aggregation=aggregation, epsilon=s.epsilon,
            beta=s.beta, ref_logp=b["ref_logp"], max_new_tokens=1, num_tokens=1, num_sequences=1,
        ).loss  # fmt: skip
        full.backward()
        assert torch.equal(skipped, full), aggregation
        assert all(torch.equal(x, p.grad) for x, p in zip(got, lora, strict=True)), aggregation
        assert any(x.abs().sum() > 0 for x in got)


def test_packed_rollouts_score_and_train_as_the_padded_ones(tmp_path):
    """data.packing auto: a causal LM's rollout batch as one packed row (per-example attention, no padding)
    gives the padded batch's old and reference log-probabilities, and the loss and LoRA gradients of every
    aggregation (a later pass: the old policy moved, so some tokens clip)."""
    from types import SimpleNamespace

    from lorakit.model.inputs import ModelInputs
    from lorakit.objectives.grpo import GrpoObjective, _packed_inputs

    model, engine, padded_source, settings = _setup(tmp_path, passes=2, beta=0.1)
    recipe = SimpleNamespace(data=SimpleNamespace(packing="auto"), model=SimpleNamespace(dtype="float32"))
    inputs = _packed_inputs(recipe, engine)
    assert isinstance(inputs, ModelInputs)
    assert (
        _packed_inputs(SimpleNamespace(data=SimpleNamespace(packing=False), model=recipe.model), engine)
        is None
    )
    _, _, source, _ = _source(model, padded_source.tokenizer, target=2, passes=2, beta=0.1)
    source.engine = source.generation = engine
    source.packed_inputs = inputs
    padded = next(iter(padded_source.windows(0, {}))).batches[0]
    packed = next(iter(source.windows(0, {}))).batches[0]
    assert torch.equal(packed["input_ids"], padded["input_ids"])  # the same completions, sampled alike
    real = int(padded["attention_mask"].sum())  # prompt and completion tokens, no padding
    assert packed["packed_input_ids"].shape == (1, real)
    assert packed["num_token_slots"] == real and packed["num_target_tokens"] == padded["num_target_tokens"]
    for key in ("old_logp", "ref_logp"):
        on = padded["completion_mask"].bool()
        assert torch.allclose(packed[key][on], padded[key][on], atol=1e-5), key
    g = torch.Generator().manual_seed(0)
    old = padded["old_logp"] + torch.randn(padded["old_logp"].shape, generator=g) * 0.3
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    for aggregation in ("grpo", "dapo", "dr_grpo"):
        objective = GrpoObjective(settings.model_copy(update={"loss": aggregation}))
        got = []
        for b in (padded, packed):
            model.zero_grad()
            loss, _ = objective.loss(engine, inputs, b | {"old_logp": old}, torch.device("cpu"))
            loss.backward()
            got.append((loss.detach(), [p.grad.clone() for p in lora]))
        (a, ga), (c, gc) = got
        assert torch.allclose(a, c, rtol=1e-5, atol=1e-7), aggregation
        # Float32 sums of per-token terms in another order: equal to ~1e-6 of the largest gradient.
        worst = max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(ga, gc, strict=True))
        assert worst < 1e-4, (aggregation, worst)
        assert any(x.abs().sum() > 0 for x in gc)
    # The backend a packed recipe's model is built with (lorakit.model.varlen's per-example SDPA): the same.
    from lorakit.model.varlen import VARLEN_SDPA, register_varlen_sdpa

    model.set_attn_implementation(register_varlen_sdpa())
    varlen = _packed_inputs(recipe, engine)
    assert varlen.attention == VARLEN_SDPA
    with torch.no_grad():
        now, want = rollout_log_probs(engine, packed, None, varlen), rollout_log_probs(engine, padded)
    on = padded["completion_mask"].bool()
    assert torch.allclose(now[on], want[on], atol=1e-5)
    assert varlen.kernels.calls  # the per-example kernel ran


def test_a_packed_run_resumed_mid_window_makes_the_uninterrupted_runs_windows(tmp_path):
    """Packed rollouts (data.packing auto) checkpoint their rows with the window: a run resumed mid-window
    trains on exactly the uninterrupted run's rollouts."""
    from lorakit.model.inputs import ModelInputs

    def setup(where):
        def made():
            model, engine, source, settings = _setup(tmp_path / where, passes=2)
            source.packed_inputs = ModelInputs(model.config, "sdpa", torch.float32)
            return model, engine, source, settings

        return made

    whole, _ = _run(setup("whole"), epochs=1)
    first, saved = _run(setup("a"), epochs=1, stop_after=1)
    assert saved[-1] == {DONE: 0, PASS: 1} and "pending.0.packed_input_ids" in saved[0]
    rest, _ = _run(setup("b"), epochs=1, resume=saved)
    assert len(first) + len(rest) == len(whole) == 4
    for got, want in zip(first + rest, whole, strict=True):
        assert torch.equal(got, want)
