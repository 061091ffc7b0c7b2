"""The model card (README.md) of an export: base, method, recipe, eval metrics, checks, versions."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorakit import rundir
from lorakit.backends import run_label
from lorakit.disclosure import redact
from lorakit.export.serving import merged_model_lines, model_type_of
from lorakit.export.sources import MergeSource
from lorakit.export.verify import Check
from lorakit.report.objective_metrics import card_lines

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


def is_hub_id(name: str) -> bool:
    """Whether `name` is a Hub repository id (OWNER/NAME), which a card's base_model may name."""
    # The hub's `base_model` field takes repository ids only, not tiny:* names or local paths.
    # OWNER/NAME, each starting with a letter or digit (so ./model and ../x are paths).
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", name)) and not Path(name).exists()


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
    if is_hub_id(src.base_name):
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
        "ordinary transformers model.",
        "",
        *merged_model_lines(auto, model_type_of(model_class)),
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
    return redact("\n".join(lines) + "\n")  # no credential in a card (lorakit/disclosure.py)


@dataclass(frozen=True)
class CardFacts:
    """What an export's model card says about the run it came from."""

    recipe_text: str | None
    labels: list[str] | None


def read_card(directory: Path) -> CardFacts:
    """The recipe (YAML) and label words of model_card's card in `directory`; None for what it lacks."""
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


# --- The Hub's model card (python -m lorakit.push, output.push_to_hub) -------------------------------------

# What a pushed repository holds at its root: the adapter, a merged (or full) model, or a merged model with
# the adapter beside it in adapter/.
LAYOUTS = ("adapter", "merged", "both")
ADAPTER_SUBFOLDER = "adapter"


@dataclass(frozen=True)
class HubFacts:
    """What a push holds and what is known about the run it came from, for its model card."""

    repo_id: str
    layout: str  # one of LAYOUTS
    method: str  # lora, qlora, ia3 or full
    base_name: str  # as the run names it (tiny:t5, a hub id, a path)
    base_load: str  # what from_pretrained loads as the base: a hub id, or a local directory
    is_encoder_decoder: bool
    recipe: Any = None  # the run's Recipe, when its run directory (or export card) holds it
    recipe_text: str | None = None
    summary: dict[str, Any] | None = None
    verification: tuple[str, ...] = ()  # the merge's check lines (merged exports)
    images: tuple[str, ...] = ()  # the PNGs the commit holds (loss.png, confusion_matrix.png)


def hub_card(f: HubFacts) -> str:
    """README.md of a pushed repository: what it is, how to load it, how it was trained and scored, the
    recipe and versions. Only what the run recorded is stated; what it did not record is left out."""
    s = f.summary or {}
    versions = s.get("versions") or rundir.versions()
    merged = f.layout != "adapter"
    front = ["---"]
    if is_hub_id(f.base_name):
        front.append(f"base_model: {f.base_name}")
    front.append(f"library_name: {'transformers' if merged else 'peft'}")
    front.append(f"pipeline_tag: {'text2text-generation' if f.is_encoder_decoder else 'text-generation'}")
    tags = ["lorakit", "full-fine-tuning" if f.method == "full" else f.method]
    tags += ["merged"] if merged and f.method != "full" else []
    front += ["tags:"] + [f"- {t}" for t in tags] + ["---", ""]
    lines = front + [f"# {f.repo_id}", "", _what(f, versions.get("lorakit")), ""]
    lines += ["## Usage", ""] + _usage(f)
    lines += ["", "## Training", ""] + _training(f, s)
    if "loss.png" in f.images:
        lines += ["", "![training loss per step](loss.png)"]
    lines += _evaluation(s, f.images) + card_lines(s)
    if f.verification:
        lines += [
            "",
            "## Verification",
            "",
            "The export was checked against the model it came from (a fixed probe batch's logits):",
            "",
        ]
        lines += [f"- {line}" for line in f.verification]
    if f.recipe_text:
        lines += ["", "## Recipe", "", "```yaml", f.recipe_text.rstrip(), "```"]
    lines += ["", "## Versions", ""] + [f"- {k}: {v}" for k, v in versions.items() if v is not None]
    if s.get("git_revision"):
        lines.append(f"- git revision of the training code: {s['git_revision']}")
    return "\n".join(lines) + "\n"


def _what(f: HubFacts, version: str | None) -> str:
    base = f"`{f.base_name}`"
    trained = f"trained with lorakit {version}" if version else "trained with lorakit"
    if f.method == "full":
        return f"{base} fully fine-tuned, {trained}."
    adapter = f"{_ADAPTER_NAMES.get(f.method, 'a LoRA')} adapter"
    if f.layout == "adapter":
        return f"{adapter[0].upper()}{adapter[1:]} for {base}, {trained}."
    where = f" The adapter itself is in `{ADAPTER_SUBFOLDER}/`." if f.layout == "both" else ""
    return f"{base} with {adapter} merged into its weights, {trained}.{where}"


def _prompt(recipe) -> str:
    """An example prompt: the run's prompt template with "..." for each column, else a plain text."""
    template = getattr(getattr(recipe, "data", None), "prompt_template", None)
    if not template:
        return "Hello"
    from lorakit.recipe.section import placeholders

    return template.format(**{name: "..." for name in placeholders(template)})


def _usage(f: HubFacts) -> list[str]:
    auto = "AutoModelForSeq2SeqLM" if f.is_encoder_decoder else "AutoModelForCausalLM"
    generate = [
        f'inputs = tokenizer({_prompt(f.recipe)!r}, return_tensors="pt")',
        "output = model.generate(**inputs, max_new_tokens=32)",
        "print(tokenizer.decode(output[0], skip_special_tokens=True))",
    ]
    blocks = []
    if f.layout != "adapter":
        blocks.append(
            [
                "An ordinary transformers model:",
                "",
                "```python",
                f"from transformers import {auto}, AutoTokenizer",
                "",
            ]
            + [
                f'model = {auto}.from_pretrained("{f.repo_id}")',
                f'tokenizer = AutoTokenizer.from_pretrained("{f.repo_id}")',
            ]
            + generate
            + ["```"]
        )
    if f.layout != "merged":
        sub = f', subfolder="{ADAPTER_SUBFOLDER}"' if f.layout == "both" else ""
        note = []
        if not is_hub_id(f.base_name):
            note = [
                f"# The base, {f.base_name}, is not on the Hub: load it from where it is on your machine."
            ]
        blocks.append(
            ["The adapter, with PEFT on its base model:", "", "```python", "from peft import PeftModel"]
            + [f"from transformers import {auto}, AutoTokenizer", ""]
            + note
            + [f'base = {auto}.from_pretrained("{f.base_load}"{_base_options(f)})']
            + [f'model = PeftModel.from_pretrained(base, "{f.repo_id}"{sub})']
            + [f'tokenizer = AutoTokenizer.from_pretrained("{f.repo_id}"{sub})']
            + generate
            + ["```"]
        )
    return [line for i, block in enumerate(blocks) for line in ([""] if i else []) + block]


def _base_options(f: HubFacts) -> str:
    """from_pretrained's options for the base the run trained on: its revision, trust_remote_code."""
    model = getattr(f.recipe, "model", None)
    options = (
        f', revision="{model.revision}"'
        if model is not None and model.revision and f.base_load == f.base_name
        else ""
    )
    return options + (", trust_remote_code=True" if model is not None and model.trust_remote_code else "")


def _number(n: Any) -> str:
    return f"{n:,}" if isinstance(n, int) else f"{n:.4g}" if isinstance(n, float) else str(n)


def _gigabytes(n: Any) -> str:
    return f"{n / 1e9:.2f} GB"


def _training(f: HubFacts, s: dict[str, Any]) -> list[str]:
    lines = [f"- base model: `{f.base_name}`"]
    r = f.recipe
    if r is not None and r.method.lora():
        m = r.method
        options = "".join(f", {o}" for o in m.options())
        quant = f", base quantized to 4 bits ({m.quantization()})" if m.quantization() else ""
        lines.append(
            f"- method: {m.kind}: r={m.r}, alpha={m.alpha:g}, dropout={m.dropout:g}, "
            f"target_modules={m.target_modules}{options}{quant}"
        )
    elif r is not None and r.method.kind == "ia3":
        lines.append(f"- method: ia3: target_modules={r.method.target_modules}")
    else:
        lines.append(f"- method: {f.method}")
    if isinstance(s.get("objective"), str):  # train.objective, as summary.json records it
        lines.append(f"- objective: {s['objective']}")
    if s.get("trainable_params") and s.get("total_params"):
        lines.append(
            f"- trainable parameters: {_number(s['trainable_params'])} of {_number(s['total_params'])}"
        )
    lines += _data_lines(r, s.get("data") or {})
    if s.get("steps") is not None:
        stop = f", stopped by {s['stop_reason']}" if s.get("stop_reason") else ""
        n = s.get("epochs")
        epochs = f" ({_number(n)} epoch{'s' if n != 1 else ''}{stop})" if n is not None else ""
        counts = f", {_number(s['train_samples'])} examples" if s.get("train_samples") is not None else ""
        tokens = (
            f", {_number(s['train_tokens'])} tokens (source and target, no padding)"
            if s.get("train_tokens")
            else ""
        )
        lines.append(f"- trained: {s['steps']} optimizer steps{epochs}{counts}{tokens}")
    loss = s.get("loss") or {}
    if loss.get("first") is not None and loss.get("last") is not None:
        lines.append(
            f"- training loss: {loss['first']:.4f} at the first step, {loss['last']:.4f} at the last"
        )
    lines += _hardware_lines(s)
    return lines


def _data_lines(recipe, data: dict[str, Any]) -> list[str]:
    if recipe is None:
        return []
    source = recipe.data.source
    names = [source] if isinstance(source, str) else [spec.source for spec in source]
    counts = []
    if data.get("train_rows") is not None:
        counts.append(f"{_number(data['train_rows'])} training rows")
    ev = data.get("eval_source") or {}
    if data.get("eval_rows") is not None:
        split = f" (split {ev['split']})" if ev.get("split") else ""
        held = " held out from the training data" if ev.get("held_out") else ""
        counts.append(f"{_number(data['eval_rows'])} evaluation rows{held}{split}")
    text = f"- data: {', '.join(f'`{n}`' for n in names)}, format {recipe.data.format}"
    lines = [text + (f": {', '.join(counts)}" if counts else "")]
    if data.get("labels"):
        # Machine-readable (read_card): the label words lorakit.generate reports a prediction's label by.
        lines.append(_LABELS + json.dumps(data["labels"]))
    return lines


def _hardware_lines(s: dict[str, Any]) -> list[str]:
    plan = s.get("plan") or {}
    if s.get("world_size") is None:
        return []
    device = plan.get("device") or "unknown device"
    nodes = plan.get("nodes")
    where = f"{s['world_size']} process{'es' if s['world_size'] != 1 else ''} on {device}"
    where += f" ({nodes} nodes)" if nodes and nodes > 1 else ""
    setup = [label] if (label := run_label(s)) else []  # the backend's: ZeRO-3, FSDP2 full sharding
    setup += [s["dtype"]] if s.get("dtype") else []
    setup += [f"attention {s['attention']}"] if s.get("attention") else []
    lines = [f"- hardware: {where}" + (f", {', '.join(setup)}" if setup else "")]
    timing = []
    if s.get("train_seconds") is not None:
        timing.append(f"{s['train_seconds']:.1f} s of training")
    if s.get("tokens_per_second"):
        timing.append(f"{s['tokens_per_second']:,.0f} tokens/s")
    peak = s.get("peak_memory_bytes") or {}
    if peak.get("gpu"):
        timing.append(f"peak GPU memory {_gigabytes(peak['gpu'])}")
    if peak.get("cpu_rss"):
        timing.append(f"peak CPU memory {_gigabytes(peak['cpu_rss'])}")
    if timing:
        lines.append(f"- time and memory: {', '.join(timing)}")
    return lines


def _evaluation(s: dict[str, Any], images: tuple[str, ...]) -> list[str]:
    metrics = s.get("eval") or {}
    c = s.get("classification")
    if not metrics and not c:
        return []
    lines = ["", "## Evaluation", "", "The run's last evaluation (summary.json; scores in percent):", ""]
    if metrics:
        lines += ["| metric | value |", "| --- | --- |"]
        lines += [f"| {k} | {v:.4f} |" for k, v in metrics.items() if isinstance(v, int | float)]
    if c and c.get("confusion_matrix"):
        columns = c.get("columns") or c["labels"]
        lines += ["", f"Confusion matrix ({c.get('examples', '?')} examples; rows: the reference label, "]
        lines[-1] += "columns: the prediction):"
        lines += ["", "| | " + " | ".join(columns) + " |", "| --- " * (len(columns) + 1) + "|"]
        for label, row in zip(c["labels"], c["confusion_matrix"], strict=False):
            lines.append(f"| {label} | " + " | ".join(str(n) for n in row) + " |")
        if "confusion_matrix.png" in images:
            lines += ["", "![confusion matrix](confusion_matrix.png)"]
    return lines
