"""The loop's step sources (lorakit/engine/steps.py): the static source resumes at its position, an older
checkpoint's field is read as that position, and a source that makes its windows from the current weights
and its own generator (as a rollout source does) resumes exactly through the loop's state and its rank
state, written into and read back from a real checkpoint directory."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from lorakit.backends import StepResult
from lorakit.data.sampler import LengthGroupedBatchSampler, ResumableBatchSampler
from lorakit.engine import checkpoint as ck
from lorakit.engine.checkpoint import LoopState
from lorakit.engine.loop import Checkpointing, LoopPolicy, Trainer
from lorakit.engine.steps import DONE, StaticSteps, StepSource, Window, plan_steps
from tests.conftest import tiny_recipe


def _static(n: int = 22, batch: int = 2, accumulation: int = 3) -> StaticSteps:
    sampler = ResumableBatchSampler(LengthGroupedBatchSampler(list(range(1, n + 1)), batch, seed=5))
    loader = DataLoader(list(range(n)), batch_sampler=sampler, collate_fn=lambda rows: {"rows": rows})
    return StaticSteps(loader, accumulation)


def test_static_steps_resume_at_their_position_with_the_rest_of_the_epoch():
    steps = _static()
    assert isinstance(steps, StepSource)
    # 11 micro-batches in windows of 3: the last window is short and ends the epoch.
    full = list(steps.windows(1, {}))
    assert [len(w.batches) for w in full] == [3, 3, 3, 2]
    assert [w.position for w in full] == [{DONE: 3}, {DONE: 6}, {DONE: 9}, {DONE: 11}]
    assert [w.last for w in full] == [False, False, False, True]
    rest = list(steps.windows(1, full[1].position))
    assert [w.batches for w in rest] == [w.batches for w in full[2:]]
    assert [w.position for w in rest] == [w.position for w in full[2:]]
    # Another epoch is another order; the same epoch again is the same one.
    assert [w.batches for w in steps.windows(2, {})] != [w.batches for w in full]
    assert [w.batches for w in steps.windows(1, {})] == [w.batches for w in full]
    assert steps.plan(epochs=2, max_steps=None) == plan_steps(11, 3, 2, None)


def test_a_checkpoint_from_before_step_sources_resumes_at_the_same_batch():
    """state.json of an older lorakit has `micro_batches_done` where the position now is."""
    old = {"step": 5, "epoch": 1, "micro_batches_done": 6, "losses": [1.0], "last_eval_step": 4}
    state = LoopState.from_saved(old)
    assert (state.step, state.epoch, state.position, state.losses) == (5, 1, {DONE: 6}, [1.0])
    assert LoopState.from_saved({**old, "micro_batches_done": 0}).position == {}
    assert LoopState.from_saved({"step": 2}).position == {}
    steps = _static()
    resumed = [w.batches for w in steps.windows(1, state.position)]
    assert resumed == [w.batches for w in steps.windows(1, {})][2:]
    # The new layout reads back as written.
    assert LoopState.from_saved(json.loads(json.dumps(asdict(state)))) == state


class _Engine:
    """The Engine verbs the loop uses, on a linear model with plain SGD: the weights alone are its state."""

    device = torch.device("cpu")

    def __init__(self, weight: torch.Tensor | None = None):
        self.model = torch.nn.Linear(4, 5, bias=False)
        if weight is not None:
            with torch.no_grad():
                self.model.weight.copy_(weight)

    def train(self) -> None:
        self.model.train()

    def backward(self, loss, *, boundary):
        loss.backward()

    def step(self):
        with torch.no_grad():
            self.model.weight -= 0.5 * self.model.weight.grad
        self.model.weight.grad = None
        return StepResult(grad_norm=1.0, applied=True, lr=0.5)

    def save_checkpoint(self, directory: Path, tag: str, *, trainable_only: bool) -> None:
        (directory / tag).mkdir()
        torch.save(self.model.weight.detach().clone(), directory / tag / "weight.pt")

    def load_checkpoint(self, directory: Path, tag: str, *, trainable_only: bool) -> None:
        with torch.no_grad():
            self.model.weight.copy_(torch.load(directory / tag / "weight.pt"))


class _Inputs:
    def logits(self, engine, batch, device):
        return engine.model(batch["x"])


class _Rollouts:
    """A source shaped as a rollout source is: each window is made when it is asked for, from the current
    weights (its labels are what the model predicts now, the "generation") and this source's own generator
    (the "prompts"), which only rank_state can bring back."""

    windows_per_epoch, accumulation = 3, 2

    def __init__(self, engine: _Engine):
        self.engine = engine
        self.gen = torch.Generator().manual_seed(11)

    def plan(self, epochs, max_steps):
        return plan_steps(self.windows_per_epoch * self.accumulation, self.accumulation, epochs, max_steps)

    def windows(self, epoch, position):
        for k in range(position.get("window", 0), self.windows_per_epoch):
            batches = []
            for _ in range(self.accumulation):
                x = torch.randn(1, 3, 4, generator=self.gen)
                with torch.no_grad():
                    labels = self.engine.model(x).argmax(-1)
                labels[0, torch.randint(0, 3, (), generator=self.gen)] = torch.randint(
                    0, 5, (), generator=self.gen
                )
                batches.append(
                    {
                        "x": x,
                        "labels": labels,
                        "num_target_tokens": 3,
                        "num_real_tokens": 3,
                        "num_token_slots": 3,
                        "num_examples": 1,
                    }
                )
            yield Window(batches, {"window": k + 1}, last=k + 1 == self.windows_per_epoch)

    def rank_state(self):
        return {"generator": self.gen.get_state()}

    def load_rank_state(self, state):
        if state:
            self.gen.set_state(state["generator"])


def _train(
    tmp_path: Path, engine: _Engine, source, state: LoopState | None = None, saves: list | None = None
):
    """The loop over `source` for 2 epochs, saving real checkpoints every 2 steps; returns {step: loss}."""
    recipe = tiny_recipe(tmp_path / "cache", tmp_path / "run")
    records = []

    def save(reason: str) -> Path:
        path = ck.save_checkpoint(
            engine,
            recipe,
            tmp_path / "run",
            trainer.state,
            {},
            adapter=True,
            reason=reason,
            rank_steps=source.rank_state(),
        )
        if saves is not None:
            saves.append(path)
        return path

    policy = LoopPolicy(source.plan(2, None), checkpointing=Checkpointing(save, every=2, at_epoch_end=False))
    trainer = Trainer(engine, _Inputs(), source, policy, records.append, state=state)
    trainer.run()
    return {r["step"]: r["loss"] for r in records}


def test_a_source_of_windows_made_from_the_current_weights_resumes_exactly(tmp_path):
    start = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
    engine = _Engine(start)
    saves: list[Path] = []
    whole = _train(tmp_path / "whole", engine, _Rollouts(engine), saves=saves)
    assert sorted(whole) == list(range(1, 7))
    # Step 4 is the second window of the second epoch: a resume in the middle of an epoch.
    step4 = ck.read_checkpoint(saves[1])
    assert step4.state["loop"]["position"] == {"window": 1} and step4.state["loop"]["epoch"] == 1
    assert (step4.path / ck.STEPS / "rank-0.safetensors").is_file()
    assert ck.damage(step4.path) is None  # the source's file is in the manifest

    def resumed(restore_source: bool) -> dict[int, float]:
        engine = _Engine()
        source = _Rollouts(engine)
        state, _, rank_steps = ck.load_checkpoint(engine, step4, adapter=True)
        if restore_source:
            source.load_rank_state(rank_steps)
        return _train(tmp_path / f"resumed-{restore_source}", engine, source, state)

    again = resumed(True)
    assert sorted(again) == [5, 6]
    assert again == {s: whole[s] for s in (5, 6)}
    # Without its generator the source makes other windows: the check above can fail.
    assert resumed(False)[5] != whole[5]


def test_a_static_source_writes_no_rank_state(tmp_path):
    """A static source's checkpoint has its position in state.json and no steps/ directory."""
    engine, steps = _Engine(), _static()
    recipe = tiny_recipe(tmp_path / "cache", tmp_path / "run")
    state = LoopState(step=2, position={DONE: 6})
    path = ck.save_checkpoint(
        engine,
        recipe,
        tmp_path / "run",
        state,
        {},
        adapter=True,
        reason="every",
        rank_steps=steps.rank_state(),
    )
    saved = json.loads((path / ck.STATE).read_text())["loop"]
    assert saved["position"] == {DONE: 6} and "micro_batches_done" not in saved
    assert not (path / ck.STEPS).exists()
    assert ck.load_checkpoint(engine, ck.read_checkpoint(path), adapter=True)[2] == {}
