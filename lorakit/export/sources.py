"""What a merge reads: a run directory, an adapter directory or a full model, and the base model to use."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorakit import rundir
from lorakit.errors import LorakitError, MergeError
from lorakit.export.adapter import CONFIG as ADAPTER_CONFIG
from lorakit.recipe import Recipe
from lorakit.recipe.read_back import NotGranted, read_back_recipe
from lorakit.recipe.schema import DataSection
from lorakit.testing import resolve_model_source

TOKENIZER_FILE = "tokenizer_config.json"


@dataclass(frozen=True)
class MergeSource:
    """The thing being exported and everything known about how it was made."""

    kind: str  # "adapter" (lora, qlora) or "full" (a complete fine-tuned model)
    path: Path  # the adapter directory, or the full model's directory
    run_dir: Path | None
    recipe: Recipe | None
    recipe_text: str | None
    summary: dict[str, Any] | None
    # The base: as the user names it (tiny:t5, a hub id, a path) and as transformers loads it.
    base_name: str
    base_source: str
    revision: str | None
    # From the person running the command (their flag or their own recipe), never from the directory read.
    trust_remote_code: bool
    # --base was given: the model the adapter was trained on (its sources, to compare architectures).
    base_overridden: bool = False
    trained_on: tuple[str, ...] = ()
    # adapter_config.json's peft_type (LORA, IA3), for an adapter without its run directory.
    peft_type: str | None = None
    # Load pickled weights (pytorch_model.bin) where there are no safetensors: the caller's choice too.
    allow_pickle: bool = False

    @property
    def method(self) -> str:
        """lora, qlora, ia3 or full (an adapter without a run directory: lora, or ia3 by its peft_type)."""
        if self.recipe is not None:
            return self.recipe.method.kind
        if self.kind == "full":
            return "full"
        return "ia3" if self.peft_type == "IA3" else "lora"

    @property
    def default_dtype(self) -> str:
        """The training dtype when the run is known, else bfloat16."""
        return self.recipe.model.dtype if self.recipe is not None else "bfloat16"

    def tokenizer_source(self) -> str:
        """Where the tokenizer comes from: the adapter or model directory (lorakit saves it there), else the
        base."""
        return str(self.path) if (self.path / TOKENIZER_FILE).is_file() else self.base_source


def read_recipe_text(
    text: str, where: Path, grants: dict[str, Any], fail: Callable[[LorakitError], LorakitError]
) -> Recipe:
    """A recipe.yaml's text as data (recipe/read_back.py) with only the caller's `grants` (trust_remote_code,
    allow_pickle, allow_code): a recipe asking for more is refused (NotGranted); any other problem is raised
    as `fail(the error)`."""
    try:
        return read_back_recipe(text, str(where), **grants)
    except NotGranted:
        raise
    except LorakitError as e:
        raise fail(e) from e


def _read_recipe(
    run_dir: Path, trust_remote_code: bool, allow_pickle: bool, allow_code: Collection[str]
) -> tuple[Recipe, str]:
    """The run's recipe.yaml and its text: trust and code only as the caller grants."""
    where = run_dir / rundir.RECIPE
    text = where.read_text()
    grants = {"trust_remote_code": trust_remote_code, "allow_pickle": allow_pickle, "allow_code": allow_code}
    recipe = read_recipe_text(
        text, where, grants, lambda e: MergeError(f"{where}: cannot read the run's recipe: {e}")
    )
    return recipe, text


def _resolve(name: str, cache_dir: str, what: str) -> str:
    try:
        return resolve_model_source(name, cache_dir)
    except LorakitError as e:
        raise MergeError(f"{what} {name!r}: {e}") from e


def _artefact(p: Path, run_dir: Path | None, recipe) -> tuple[bool, Path]:
    """(whether it is a full model, the directory to export) for the directory `p`."""
    if p == run_dir:
        full = not recipe.method.adapter()
        artefact = p / (rundir.MODEL if full else rundir.ADAPTER)
        if not artefact.is_dir():
            what = "model" if full else "adapter"
            raise MergeError(
                f"{p}: a {recipe.method.kind} run without its {artefact.name}/ directory: training did not "
                f"finish, or output.save_adapter was false; there is no {what} to export",
                doc="docs/merge.md#options",
            )
        return full, artefact
    if (p / ADAPTER_CONFIG).is_file() or (p / "config.json").is_file():
        return not (p / ADAPTER_CONFIG).is_file(), p
    raise MergeError(
        f"{p}: neither a run directory (no {rundir.RECIPE}), an adapter directory (no {ADAPTER_CONFIG}) "
        "nor a model directory (no config.json)",
        doc="docs/merge.md#options",
    )


def locate(
    path: str | Path,
    base: str | None = None,
    *,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    allow_code: Collection[str] = (),
) -> MergeSource:
    """Find what `path` is (run dir, adapter dir, model dir) and which base model the merge uses.

    trust_remote_code, allow_pickle: the caller's (its command line, or its own recipe for output.merge);
    a run directory's recipe.yaml never grants them (a downloaded snapshot has one too), and is refused
    when it asks for them. allow_code: the modules (--allow-code) its code fields may import.

    The base is `base` when given (tiny:* names resolve under the recipe's data.cache_dir), else the run's
    model.name_or_path, else the base_model_name_or_path peft recorded in adapter_config.json."""
    p = Path(path).expanduser().resolve()
    if not p.is_dir():
        raise MergeError(
            f"{path}: no such directory (expected a run directory or an adapter directory)",
            doc="docs/merge.md#options",
        )
    run_dir = p if (p / rundir.RECIPE).is_file() else None
    if run_dir is None and (p.parent / rundir.RECIPE).is_file():
        run_dir = p.parent  # RUN/adapter or RUN/model given directly
    recipe, recipe_text = (
        _read_recipe(run_dir, trust_remote_code, allow_pickle, allow_code)
        if run_dir is not None
        else (None, None)
    )
    summary_file = run_dir / rundir.SUMMARY if run_dir is not None else None
    summary = json.loads(summary_file.read_text()) if summary_file and summary_file.is_file() else None

    full, artefact = _artefact(p, run_dir, recipe)
    cache_dir = recipe.data.cache_dir if recipe is not None else DataSection.model_fields["cache_dir"].default
    common = dict(path=artefact, run_dir=run_dir, recipe=recipe, recipe_text=recipe_text, summary=summary)
    if full:
        if base is not None:
            raise MergeError(
                f"--base: {artefact} is a complete fine-tuned model; it has no base to merge into",
                doc="docs/merge.md#full-fine-tuning-runs",
            )
        name = recipe.model.name_or_path if recipe is not None else str(artefact)
        return MergeSource(
            "full",
            base_name=name,
            base_source=str(artefact),
            revision=None,
            trust_remote_code=trust_remote_code,
            allow_pickle=allow_pickle,
            **common,
        )

    trained_on = []
    if recipe is not None:
        trained_on.append((recipe.model.name_or_path, recipe.model.revision))
    adapter_cfg = _adapter_config(artefact)
    if adapter_cfg.get("base_model_name_or_path"):
        trained_on.append((adapter_cfg["base_model_name_or_path"], adapter_cfg.get("revision")))
    if base is not None:
        name, revision = base, None
    elif trained_on:
        name, revision = trained_on[0]
    else:
        raise MergeError(
            f"{artefact / ADAPTER_CONFIG} names no base model; pass --base MODEL", doc="docs/merge.md#options"
        )
    source = _resolve(name, cache_dir, "--base" if base is not None else "base model")
    return MergeSource(
        "adapter",
        base_name=name,
        base_source=source,
        revision=revision,
        trust_remote_code=trust_remote_code,
        allow_pickle=allow_pickle,
        base_overridden=base is not None,
        trained_on=tuple(_resolve(n, cache_dir, "trained-on model") for n, _ in trained_on),
        peft_type=adapter_cfg.get("peft_type"),
        **common,
    )


def _adapter_config(path: Path) -> dict[str, Any]:
    f = path / ADAPTER_CONFIG
    try:
        return json.loads(f.read_text()) if f.is_file() else {}
    except json.JSONDecodeError:
        return {}  # read_adapter reports it
