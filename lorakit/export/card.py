"""The model card (README.md) of an export: base, method, recipe, eval metrics, checks, versions."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from lorakit import rundir
from lorakit.export.sources import MergeSource
from lorakit.export.verify import Check

CARD = "README.md"
# The card's machine-readable lines, which read_card parses back.
_LABELS = "- labels: "
_RECIPE = re.compile(r"^## Recipe\n\n```yaml\n(.*?)\n```$", re.MULTILINE | re.DOTALL)

QLORA_NOTE = (
    "QLoRA run: the adapter was trained on the base quantized to 4 bits; it is merged into the base loaded "
    "unquantized in {dtype} (the dequantized base, not the 4-bit weights), and the check compares against "
    "the adapter on that same unquantized base."
)


_ADAPTER_NAMES = {"qlora": "a QLoRA", "ia3": "an IA3"}


def _hub_id(name: str) -> bool:
    # The hub's `base_model` field takes repository ids only, not tiny:* names or local paths.
    return bool(re.fullmatch(r"[\w.-]+/[\w.-]+", name)) and not Path(name).exists()


def model_card(
    src: MergeSource,
    *,
    dtype: str,
    model_class: str,
    is_encoder_decoder: bool,
    shards: int,
    checks: list[Check],
    notes: list[str],
) -> str:
    """README.md text for the exported model."""
    versions = rundir.versions()
    method = src.method
    tags = ["lorakit", "full-fine-tuning" if method == "full" else method]
    if method != "full":
        tags.append("merged")
    front = ["---"]
    if _hub_id(src.base_name):
        front.append(f"base_model: {src.base_name}")
    front += ["library_name: transformers"]
    front.append(f"pipeline_tag: {'text2text-generation' if is_encoder_decoder else 'text-generation'}")
    front += ["tags:"] + [f"- {t}" for t in tags] + ["---", ""]

    auto = "AutoModelForSeq2SeqLM" if is_encoder_decoder else "AutoModelForCausalLM"
    what = (
        "fully fine-tuned"
        if method == "full"
        else f"{_ADAPTER_NAMES.get(method, 'a LoRA')} adapter merged into its weights"
    )
    lines = front + [
        f"# {model_class}: `{src.base_name}`, {what}",
        "",
        f"Exported by lorakit {versions.get('lorakit')} (`python -m lorakit.merge`) as {dtype} safetensors "
        f"({shards} shard{'s' if shards != 1 else ''}), with its tokenizer and generation config. It is an "
        "ordinary transformers model:",
        "",
        "```python",
        f"from transformers import {auto}, AutoTokenizer",
        "",
        f'model = {auto}.from_pretrained("path/to/this/directory")',
        'tokenizer = AutoTokenizer.from_pretrained("path/to/this/directory")',
        "```",
        "",
        "## Source",
        "",
        f"- base model: `{src.base_name}`" + (" (given with --base)" if src.base_overridden else ""),
        f"- method: {method}",
        f"- exported from: `{src.path}`",
    ]
    if src.recipe is not None and src.recipe.method.lora():
        m = src.recipe.method
        options = "".join(f", {o}" for o in m.options())
        lines.append(f"- LoRA: r={m.r}, alpha={m.alpha:g}, target_modules={m.target_modules}{options}")
    elif src.recipe is not None and method == "ia3":
        lines.append(f"- IA3: target_modules={src.recipe.method.target_modules}")
    labels = ((src.summary or {}).get("data") or {}).get("labels")
    if labels:
        # The label words of a classifier run, for lorakit.generate's `label` field.
        lines.append(_LABELS + json.dumps(labels))
    lines += [f"- {note}" for note in notes]
    metrics = (src.summary or {}).get("eval") or {}
    if metrics:
        lines += ["", "## Evaluation (the run's summary.json, adapter model)", "", "| metric | value |"]
        lines += ["| --- | --- |"] + [f"| {k} | {v:.4f} |" for k, v in metrics.items()]
    lines += [
        "",
        "## Verification",
        "",
        "A fixed probe batch (4 seeded token sequences of 32 tokens) ran through the reference and through this "
        "model; the export is refused when the largest logit difference exceeds the tolerance.",
        "",
    ]
    lines += [f"- {c.describe()}" for c in checks]
    if src.recipe_text:
        lines += ["", "## Recipe", "", "```yaml", src.recipe_text.rstrip(), "```"]
    lines += ["", "## Versions", ""]
    lines += [f"- {k}: {v}" for k, v in versions.items() if v is not None]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class CardFacts:
    """What an export's model card says about the run it came from."""

    recipe_text: str | None
    labels: list[str] | None


def read_card(directory: Path) -> CardFacts:
    """The run's recipe (YAML text) and label words from the model card model_card wrote into `directory`;
    None for what the card does not hold (or when there is no card, or another tool wrote it)."""
    path = Path(directory) / CARD
    text = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
    recipe = _RECIPE.search(text)
    labels = None
    for line in text.splitlines():
        if line.startswith(_LABELS):
            try:
                labels = json.loads(line.removeprefix(_LABELS))
            except json.JSONDecodeError:
                labels = None
            break
    if not (isinstance(labels, list) and all(isinstance(x, str) for x in labels)):
        labels = None
    return CardFacts(recipe[1] + "\n" if recipe else None, labels)
