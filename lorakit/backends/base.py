"""The two types of a sharding backend, in lorakit's own words, so the job, the loop, saving and checkpoints
never name DeepSpeed or FSDP, never ask `hasattr`, and never branch on a ZeRO stage.

`Backend` is what the job asks before the model exists: check the process group, the config the run
directory records, the load plan build_model follows, and `wrap` the built model into an `Engine`; and what
the launcher, the planner, the doctor and the run's description ask of the strategy (lorakit.backends.facts).
`Engine` is what the loop, evaluation, saving and checkpoints ask of the wrapped model.

The accumulation window is the loop's: `backward(loss, boundary=...)` for each micro-batch, `boundary`
True on the window's last, then one `step()`, which applies the window's update and says how it went.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from lorakit.backends.facts import ByteModels, Layout, Readiness
    from lorakit.model.load_plan import LoadPlan


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did: the window's gradient norm over every rank before clipping (None when
    the backend did not compute one), whether the update was applied (False: a non-finite gradient made
    the backend skip it), and the learning rate of the first parameter group after the step."""

    grad_norm: float | None
    applied: bool
    lr: float


class IncompleteSaveError(RuntimeError):
    """A gathered weight came back empty or mis-shaped: saving would write a broken adapter."""


@runtime_checkable
class Engine(Protocol):
    """A built model wrapped by a backend: forward, backward, step, its whole state, checkpoints, release.

    `module` is the (peft) model itself; `device` where batches go; `sharded` whether each rank holds
    only a shard of the parameters, so every forward (and generate) is collective: all ranks take part in
    the same number of them."""

    module: torch.nn.Module
    device: torch.device
    sharded: bool

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward."""
        ...

    def train(self) -> None:
        """Training mode (dropout on)."""
        ...

    def eval(self) -> None:
        """Evaluation mode (dropout off)."""
        ...

    def generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **sampling: Any
    ) -> torch.Tensor:
        """transformers' generate with the weights this engine holds, in eval mode (the mode put back after):
        the ids it returns (causal LMs: prompt + continuation). Collective when `sharded`: every rank calls
        it as many times, each with its own prompts (ZeRO-3 gathers each layer's parameters for its forward,
        FSDP2 unshards them; a rank done early keeps taking part). `sampling`: generate's arguments."""
        ...

    def generation_weights(self) -> contextlib.AbstractContextManager[bool]:
        """The weights generation runs on, as a context (collective when `sharded`): yields True when they
        are whole on this rank for its duration (never sharded, or gathered once on entry:
        distributed.gather_for_generation), so each rank generates on its own; False when every forward
        gathers them layer by layer, so the ranks must take part in as many forwards (synced generation)."""
        ...

    def backward(self, loss: torch.Tensor, *, boundary: bool) -> None:
        """Backpropagate `loss` as given (the loop weighted it); `boundary`: this is the accumulation
        window's last micro-batch, whose backward completes the window's gradients."""
        ...

    def step(self) -> StepResult:
        """Apply the window's update (clipping, optimizer, LR schedule) and clear its gradients."""
        ...

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups (each with its `lr`, and `initial_lr` under the schedule)."""
        ...

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The trainable weights by parameter name, whole and on CPU, on every rank (collective); checked
        against their full shapes (IncompleteSaveError)."""
        ...

    def full_model_state(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights gathered into rank 0's CPU memory (collective): a dict on rank 0, None
        elsewhere; None on every rank where the module's own state_dict is already whole."""
        ...

    def save_checkpoint(self, directory: Path, tag: str, *, trainable_only: bool) -> None:
        """This rank's share of a resumable checkpoint (weights, optimizer and LR-schedule state) under
        directory/tag (collective); `trainable_only`: leave the frozen weights out."""
        ...

    def load_checkpoint(self, directory: Path, tag: str, *, trainable_only: bool) -> None:
        """Restore what save_checkpoint wrote (collective); raises when nothing could be loaded."""
        ...

    def close(self) -> None:
        """Undo the process-wide state the engine left, so a later job in this process starts clean."""
        ...


class Forwarding:
    """An engine's forward, train/eval mode and generate, passed on to what it wraps (`self.inner`:
    DeepSpeed's engine, or the sharded module; `self.module`: the (peft) model)."""

    inner: Any
    module: Any
    sharded: bool
    # distributed.gather_for_generation, and whether a _gathering context holds the weights whole now.
    gather_for_generation: bool | str = "auto"
    _gathered: bool = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)

    def train(self) -> None:
        """Training mode (dropout on)."""
        self.inner.train()

    def eval(self) -> None:
        """Evaluation mode (dropout off)."""
        self.inner.eval()

    @contextlib.contextmanager
    def generation_weights(self):
        """Whole where nothing is sharded; a sharded engine that can gather its weights for generation says
        so itself (Engine.generation_weights)."""
        yield not self.sharded

    @contextlib.contextmanager
    def _gathering(self, adds: Callable[[], int], gather: Callable[[], Any]):
        """generation_weights of a sharded engine: `gather()` (a context holding the weights whole) when
        distributed.gather_for_generation allows `adds()` bytes more (yields True), else layer by layer
        (False). Nested in its own gathered context: whole, as the outer one keeps them (a second gather
        would put DeepSpeed's hooks back twice, or reshard FSDP2's modules under the outer one)."""
        if self._gathered:
            yield True
            return
        if not gathers_for_generation(self.gather_for_generation, adds(), self.device):
            yield False
            return
        with gather():
            self._gathered = True
            try:
                yield True
            finally:
                self._gathered = False

    def generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **sampling: Any
    ) -> torch.Tensor:
        """transformers' generate on the (peft) module, through evaluation's generate_ids, on the weights
        generation_weights gives; synced over the ranks where they stay sharded."""
        from lorakit import dist
        from lorakit.evaluation.generate import generate_ids

        with self.generation_weights() as whole:
            synced = not whole and dist.world_size() > 1
            return generate_ids(self.module, input_ids, attention_mask, synced_gpus=synced, **sampling)


# distributed.gather_for_generation auto: gather when the bytes gathering adds take at most this share of the
# memory free on the device (on every rank); the rest is left to the KV cache and the logits.
GATHER_SHARE = 0.5


def gather_fits(gathered_bytes: int, free_bytes: int) -> bool:
    """distributed.gather_for_generation auto's rule: the bytes gathering adds fit in GATHER_SHARE of what is
    free (the runtime asks it with the device's free memory, the planner with its estimate of it)."""
    return gathered_bytes <= GATHER_SHARE * free_bytes


def gathers_for_generation(setting: bool | str, gathered_bytes: int, device: torch.device) -> bool:
    """Whether generation gathers the weights whole (distributed.gather_for_generation, `setting`): True,
    False, or auto: when the `gathered_bytes` gathering adds on this rank fit in GATHER_SHARE of the
    device's free memory on every rank (collective under auto: all ranks take the same branch)."""
    if setting != "auto":
        return bool(setting)
    import psutil
    import torch

    from lorakit import dist

    if device.type == "cuda":
        # The driver's free memory and what torch's caching allocator holds unused (free to torch too).
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        free = torch.cuda.mem_get_info(device)[0] + cached
    else:
        free = psutil.virtual_memory().available
    fits = gather_fits(gathered_bytes, free)
    return dist.all_reduce([0.0 if fits else 1.0], op="max")[0] == 0.0


@runtime_checkable
class Backend(Protocol):
    """A sharding backend (distributed.strategy), built from the recipe: everything strategy-specific that the
    job, the launcher, the planner, the doctor and the run's description ask (no code outside
    lorakit.backends compares the strategy)."""

    # The run directory's file for `describe()`'s config.
    config_file: str

    def check_before_launch(self, processes: int, per_node: int | None) -> None:
        """Refuse (RecipeError), before the data is prepared and the workers start, what `processes` processes
        (`per_node` of them on a node; None: not known) on this machine cannot run."""
        ...

    def check_group(self) -> None:
        """Refuse (RecipeError), before any work, what this process group cannot run."""
        ...

    def describe(self, model_config: Any) -> dict[str, Any]:
        """The backend's resolved config for this group and model, as the run directory records it."""
        ...

    def describe_run(self) -> dict[str, Any]:
        """How the run is sharded, for summary.json's `backend` and the model card: `strategy`, a short
        `label` (ZeRO-3, FSDP2 full sharding) and the settings that made it."""
        ...

    def load_plan(self, config: dict[str, Any]) -> LoadPlan:
        """How build_model loads the model under `config` (describe's): partitioned, meta or whole."""
        ...

    def wrap(self, built: Any, config: dict[str, Any], schedule: Callable[[Any], Any]) -> Engine:
        """The built model (lorakit.model.BuiltModel) as an Engine over its trainable parameters, with
        `config` (describe's) and `schedule` (a callable(optimizer) -> LR scheduler)."""
        ...

    def layout(self) -> Layout:
        """Where the recipe keeps the model states, as the planner plans them."""
        ...

    def layouts(self) -> list[Layout]:
        """Every layout the planner may try for this backend, in the order it prefers them on a tie."""
        ...

    def layout_overrides(self, layout: Layout) -> list[str]:
        """The dotted recipe overrides that turn the recipe's layout into `layout` (empty: the same)."""
        ...

    def planned_states(
        self, layout: Layout, models: ByteModels, *, world: int, per_node: int, hidden_size: int | None,
        accelerator: str,
    ) -> Any:  # fmt: skip
        """The model states of `layout` on `world` processes (`per_node` per node), from the byte model of
        `models` this backend shards by (what it returns)."""
        ...

    def environment(self) -> Readiness:
        """Whether this machine's libraries can run the backend (the doctor's line)."""
        ...


def gather_trainable(
    module: torch.nn.Module,
    *,
    gathered: Callable[[list[torch.nn.Parameter]], Any] = lambda params: contextlib.nullcontext(),
    whole: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    full_shape: Callable[[torch.nn.Parameter], tuple[int, ...]] = lambda p: tuple(p.shape),
) -> dict[str, torch.Tensor]:
    """The trainable weights of `module`, whole and on CPU: `gathered(params)` is a context inside which
    they are whole, `whole(p)` the whole tensor of one, `full_shape(p)` the shape it must have.

    Every tensor is checked against its full shape, so an adapter can never be saved empty or partial,
    the failure users of other ZeRO-3 tools met as 100 KB adapter files."""
    trainable = {n: p for n, p in module.named_parameters() if p.requires_grad}
    with gathered(list(trainable.values())):
        expected = {n: full_shape(p) for n, p in trainable.items()}
        full = {n: whole(p).detach().to("cpu", copy=True) for n, p in trainable.items()}
    for name, tensor in full.items():
        if tensor.numel() == 0 or tuple(tensor.shape) != expected[name]:
            raise IncompleteSaveError(
                f"{name}: gathered shape {tuple(tensor.shape)}, expected {expected[name]}"
            )
    return full
