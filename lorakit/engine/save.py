"""Saving what was trained: a standard PEFT adapter (or a full model), whole even where the backend shards it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lorakit import dist, rundir, storage
from lorakit.backends import Engine, IncompleteSaveError


def gather_adapter_state(engine: Engine) -> dict[str, torch.Tensor]:
    """The trainable (LoRA) weights by parameter name, whole and on CPU, on every rank (collective), each
    checked against its full shape by the engine (IncompleteSaveError)."""
    from peft import get_peft_model_state_dict

    full = engine.trainable_state()
    # The same filter save_pretrained applies: an adapter with no LoRA weights in it is an error, not a file.
    if not get_peft_model_state_dict(engine.module, state_dict=full):
        raise IncompleteSaveError("the model has no adapter weights to save")
    return full


def for_original_base(model, state: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]):
    """The adapter of a PiSSA / OLoRA run as a plain LoRA adapter on the original (unmutated) base, in
    peft's saved format: peft's `subtract_mutated_init` writes the update A B - A0 B0 as the rank-2r pair
    [A | A0], [B | -B0].

    peft's own route (save_pretrained's path_initial_model_for_weight_conversion) reloads the initial
    adapter into the model and reads `state_dict` as if it held that adapter, which fails with a gathered
    state dict of sharded parameters; so it is called here with the initial weights given as that adapter's state."""
    from peft import get_peft_model_state_dict

    saved = get_peft_model_state_dict(model, state_dict=state)
    # The LoraModel's own parameter names (without PeftModel's "base_model." prefix), as it expects them.
    initial = {k.removeprefix("base_model."): v for k, v in initial.items()}
    lora = model.base_model.subtract_mutated_init(saved, "default", {"state_dict": initial})
    # subtract_mutated_init returns only lora_A / lora_B; modules_to_save's weights are kept as they are.
    return {**saved, **lora}


def _convert_saved_config(directory: Path) -> None:
    """adapter_config.json of a converted adapter: rank 2r at the same scaling, plain LoRA init (the
    changes peft's save_pretrained makes for path_initial_model_for_weight_conversion)."""
    from peft import LoraConfig

    config = LoraConfig.from_pretrained(str(directory))
    config.init_lora_weights = True
    config.r *= 2
    # scaling alpha / r (rsLoRA: alpha / sqrt(r)) stays the same at rank 2r
    config.lora_alpha *= 2**0.5 if config.use_rslora else 2
    config.save_pretrained(str(directory))


def _write_for_original_base(model, state, initial, directory: Path) -> None:
    """Replace the adapter save_pretrained wrote (relative to the mutated base) by its conversion."""
    from safetensors.torch import save_file

    converted = {k: v.contiguous() for k, v in for_original_base(model, state, initial).items()}
    save_file(converted, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    _convert_saved_config(directory)


def save_trained(
    engine: Engine,
    built,
    recipe,
    run_dir: Path,
    *,
    into: str | None = None,
    info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Save the adapter (lora, qlora) to run_dir/adapter or the full model to run_dir/model; return the
    paths. Each is written beside its final name and renamed into place, so a full disk or a crash never
    leaves a partial adapter under the name merge and users read.

    `into`: another directory name under run_dir (the best evaluation's weights: `best`); `info`: written
    as rundir.BEST_INFO inside it, in the same rename, so the weights and what they are never disagree."""
    model = engine.module

    def _info(tmp: Path) -> None:
        if info is not None:
            rundir.write_json(tmp / rundir.BEST_INFO, info)

    if recipe.method.adapter():
        state = gather_adapter_state(engine)
        out = run_dir / (into or rundir.ADAPTER)

        def write_adapter() -> None:
            with storage.writing("the adapter", out), storage.new_directory(out) as tmp:
                # peft maps parameter names to its adapter format; handing it the gathered tensors means it
                # never reads the (sharded, possibly empty) parameters itself.
                model.save_pretrained(str(tmp), state_dict=state, safe_serialization=True)
                if built.initial_adapter is not None:
                    _write_for_original_base(model, state, built.initial_adapter, tmp)
                built.tokenizer.save_pretrained(str(tmp))
                _info(tmp)

        # Rank 0 writes; its failure reaches every rank in the same collective (dist.py).
        dist.on_main("adapter save", write_adapter)
        return {"adapter_dir": str(out)}
    out = run_dir / (into or rundir.MODEL)
    # Gathered from every rank's shards into rank 0's CPU memory (collective); None: the module's own.
    state = engine.full_model_state()

    def write_model() -> None:
        with storage.writing("the model", out), storage.new_directory(out) as tmp:
            model.save_pretrained(str(tmp), state_dict=state, safe_serialization=True)
            built.tokenizer.save_pretrained(str(tmp))
            _info(tmp)

    dist.on_main("model save", write_model)
    return {"model_dir": str(out)}
