"""The reference of full fine-tuning DPO: the initial model's log-probabilities, computed once and cached.

With an adapter the reference is the policy with its adapter turned off (lorakit.objectives.dpo). Full
fine-tuning changes every weight, so before the first step the model as loaded (the same engine: no second
copy) runs over every training and eval pair in eval mode under no_grad, and the summed log-probabilities
of each pair's chosen and rejected response are kept. Every rank takes its share of the pairs with the same
number of forwards (lorakit.evaluation.generate.eval_plan: ZeRO-3 gathers parameters collectively), then one
all_reduce gives every rank the whole table. Pairs are scored padded (the eval collator), whatever the
training layout.

The table is cached beside the prepared dataset (data.cache_dir/datasets/KEY/reference/), keyed by the
dataset's own fingerprint, the recipe's model section, the base weights' files and the method: a rerun or a
resumed run reuses it (a resume never recomputes from trained weights), a changed model does not. It is
computed before a checkpoint is loaded, so even a resume whose cache was deleted scores the initial model.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

import torch

from lorakit import dist, storage
from lorakit.data import cache
from lorakit.data.pair_collate import add_reference

# Bump when the reference computation changes for the same inputs, so stale tables are not reused.
FORMAT_VERSION = 1
SUBDIR = "reference"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".json")


def weights_fingerprint(source: str, revision: str | None) -> list:
    """What identifies the base weights at `source` without reading them: for a local directory, the name,
    size and modification time of its weight and config files; for a hub model in the local cache, its
    snapshot's files by their content-addressed blobs; else the id and revision."""
    path = Path(source)
    if not path.is_dir():
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(source, "config.json", revision=revision)
        if not isinstance(found, str):
            return [source, revision]
        path = Path(found).parent
    out = []
    for f in sorted(path.iterdir()):
        if f.is_file() and f.suffix in _WEIGHT_SUFFIXES:
            st = f.stat()
            out.append([f.name, os.path.basename(os.path.realpath(f)), st.st_size, st.st_mtime_ns])
    return out


def reference_key(recipe, source: str, data) -> str:
    """The cache key of the reference table of `recipe`'s base at `source` over `data` (PreparedData)."""
    return cache.fingerprint(
        {
            "reference": FORMAT_VERSION,
            "data": data.path.name,
            "model": recipe.model.model_dump(mode="json"),
            "weights": weights_fingerprint(source, recipe.model.revision),
            "method": recipe.method.kind,
        }
    )


def reference_path(data, key: str) -> Path:
    """Where the reference table `key` of `data` (PreparedData) is cached."""
    return data.path / SUBDIR / f"{key}.safetensors"


def _splits(data) -> dict:
    return {"train": data.train} | ({"eval": data.eval} if data.eval is not None else {})


@torch.no_grad()
def compute_reference(engine, inputs, objective, ds, collator, batch_size: int) -> torch.Tensor:
    """(pairs, 2) float64: this rank's share of `ds`'s (chosen, rejected) log-probabilities under the model
    as it is now, in eval mode; zeros in the rows other ranks score. Every rank must call it."""
    from lorakit.evaluation.generate import eval_plan

    model = getattr(engine, "module", engine)
    was_training = model.training
    model.eval()
    table = torch.zeros(len(ds), 2, dtype=torch.float64)
    try:
        for rows, real in eval_plan(len(ds), batch_size, dist.world_size(), dist.rank()):
            batch = collator([ds[i] for i in rows])
            found = objective.log_probs(engine, inputs, batch, engine.device).reshape(-1, 2)
            if real:
                table[rows[:real]] = found[:real].detach().cpu().double()
    finally:
        model.train(was_training)
    return table


def load_tables(path: Path, sizes: dict[str, int]) -> dict[str, torch.Tensor] | None:
    """The cached tables at `path` when it holds one of the right size for every split in `sizes`."""
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    tables = load_file(str(path))
    if any(name not in tables or tables[name].shape != (n, 2) for name, n in sizes.items()):
        return None
    return {name: tables[name] for name in sizes}


def save_tables(path: Path, tables: dict[str, torch.Tensor]) -> None:
    """Write the tables atomically (a reader finds the whole file or none)."""
    from safetensors.torch import save_file

    with storage.writing("the DPO reference log-probabilities (data.cache_dir)", path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
        os.close(fd)
        try:
            save_file({k: v.float().contiguous() for k, v in tables.items()}, tmp)
            storage.fsync_file(tmp)  # durable before it is renamed in, and the rename after it
            os.replace(tmp, path)
            storage.fsync_dir(path.parent)
        finally:
            Path(tmp).unlink(missing_ok=True)


def attach_reference(recipe, engine, inputs, objective, source: str, data, collator):
    """`data` (PreparedData) with every pair's reference log-probabilities as columns: from the cache, or
    computed now by `engine`'s model (which must not have stepped yet) and cached. Every rank must call it,
    before any checkpoint is loaded."""
    key = reference_key(recipe, source, data)
    path = reference_path(data, key)
    splits = _splits(data)
    sizes = {name: len(ds) for name, ds in splits.items()}
    cached = dist.on_main("dpo reference", load_tables, path, sizes)
    # Rank 0 decides for all: where nodes do not share data.cache_dir, the others could not read it.
    hit = bool(dist.broadcast_object(cached is not None))
    batch_size = recipe.eval.micro_batch_size or recipe.train.micro_batch_size
    tables = {}
    with dist.phase("dpo reference"):
        for name, ds in splits.items():
            if hit:
                mine = cached[name].double() if cached is not None else torch.zeros(len(ds), 2)
            else:
                mine = compute_reference(engine, inputs, objective, ds, collator, batch_size)
            # Each value was found by one rank (or read by rank 0), the others add zeros: exact.
            values = dist.all_reduce(mine.reshape(-1).tolist())
            tables[name] = torch.tensor(values, dtype=torch.float64).reshape(-1, 2).float()
    if not hit:
        dist.on_main("dpo reference save", save_tables, path, tables)
    if dist.is_main():
        state = "reused" if hit else "computed and cached"
        counts = " + ".join(f"{n} {name}" for name, n in sizes.items())
        print(f"dpo reference: {state} the initial model's log-probabilities of {counts} pairs at {path}")
    added = {name: add_reference(ds, tables[name], key) for name, ds in splits.items()}
    return dataclasses.replace(data, train=added["train"], eval=added.get("eval"))


def reference_from_cache(recipe, source: str, data):
    """`data` with the reference columns that training cached for it (lorakit.evaluate of a full
    fine-tuning DPO run, which has only the trained model); InferenceError when there are none."""
    from lorakit.errors import InferenceError

    path = reference_path(data, reference_key(recipe, source, data))
    splits = _splits(data)
    tables = load_tables(path, {name: len(ds) for name, ds in splits.items()})
    if tables is None:
        raise InferenceError(
            "a full fine-tuning DPO run is scored against the initial model's log-probabilities, which "
            f"training computes for its own train and eval pairs and caches; there are none for these pairs at "
            f"{path}. Evaluate the run's own eval split with its data.cache_dir, or train with an adapter "
            "(method.kind lora), whose reference needs no cache"
        )
    added = {name: add_reference(ds, tables[name], path.stem) for name, ds in splits.items()}
    return dataclasses.replace(data, train=added["train"], eval=added.get("eval"))
