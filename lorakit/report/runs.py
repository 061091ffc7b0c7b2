"""Reading run directories for a comparison: summary.json and metrics.jsonl, tolerant of what older or
CPU-only runs leave out (every missing value is None, shown as "n/a"), strict about what is not a run."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorakit import rundir
from lorakit.errors import LorakitError
from lorakit.recipe.known_objectives import specs
from lorakit.recipe.objective_spec import SFT, ObjectiveSpec


class CompareError(LorakitError):
    """A comparison cannot start: a path that is not a finished run, a run given twice, no runs."""


@dataclass
class RunRow:
    """One run as the comparison sees it: its numbers (None where the run did not record them) and curves."""

    path: Path
    label: str
    method: str | None = None
    # QLoRA: the base's 4-bit type as summary.json records it (bitsandbytes-nf4); None otherwise.
    quantization: str | None = None
    # The method's options (summary.json's method_options): dora, rslora, pissa, lora+ x16, ...
    method_options: list[str] = field(default_factory=list)
    model: str | None = None
    world_size: int | None = None
    zero_stage: int | None = None
    dtype: str | None = None
    trainable_params: int | None = None
    total_params: int | None = None
    steps: int | None = None
    train_tokens: int | None = None
    tokens_per_second: float | None = None
    train_seconds: float | None = None
    peak_gpu_bytes: int | None = None
    peak_cpu_rss_bytes: int | None = None
    # "gpu" when the run recorded GPU memory, "cpu" when it recorded none (torch saw no CUDA device), None
    # when the summary predates the memory record.
    device: str | None = None
    loss_first: float | None = None
    loss_last: float | None = None
    eval: dict[str, float] = field(default_factory=dict)
    # The run's train.objective, as its summary.json records it (objective_of). A loss that is not SFT's
    # token cross-entropy (DPO's) carries its objective's loss_label: its eval loss is shown as
    # `dpo loss`, apart from an SFT run's cross-entropy.
    objective: str = SFT.name
    loss_label: str | None = None
    # summary.json's objective_metrics (GRPO's rollouts), when it has them.
    objective_metrics: dict[str, Any] | None = None
    train_records: list[dict[str, Any]] = field(default_factory=list)
    eval_records: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def method_label(self) -> str:
        """`lora`, `full`, `qlora (nf4)`, `lora (dora, rslora)`, `ia3`: the method with the base's 4-bit type
        and the method's options where there are any."""
        method = self.method or "n/a"
        details = [self.quantization.removeprefix("bitsandbytes-")] if self.quantization else []
        details += self.method_options
        return f"{method} ({', '.join(details)})" if details else method

    def gpu_hours(self) -> float | None:
        """Training hours x processes: the device-hours a cost is charged on (None if either is missing)."""
        if self.train_seconds is None or self.world_size is None:
            return None
        return self.train_seconds / 3600 * self.world_size

    def cost(self, gpu_hour_price: float) -> float | None:
        """gpu_hours x price; on a CPU run, what the same hours would cost as GPU hours."""
        hours = self.gpu_hours()
        return None if hours is None else hours * gpu_hour_price

    def trainable_share(self) -> float | None:
        """Trainable parameters / all parameters."""
        if self.trainable_params is None or not self.total_params:
            return None
        return self.trainable_params / self.total_params


def _number(value: Any, kind: type) -> Any:
    # A bool is an int to Python, and a string is not a number: neither belongs in a numeric column.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return kind(value)


def _read_summary(path: Path) -> dict[str, Any]:
    file = path / rundir.SUMMARY
    if not path.exists():
        raise CompareError(f"{path}: no such directory")
    if not path.is_dir():
        raise CompareError(f"{path}: not a directory; give the run directory (the one holding summary.json)")
    if not file.is_file():
        hint = (
            " (it has metrics.jsonl: the run has not finished, or it stopped before writing its summary)"
            if (path / rundir.METRICS).is_file()
            else ""
        )
        raise CompareError(f"{path}: not a lorakit run directory: no {rundir.SUMMARY}{hint}")
    try:
        summary = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CompareError(f"{file}: unreadable ({e})") from None
    if not isinstance(summary, dict):
        raise CompareError(f"{file}: expected a JSON object, found {type(summary).__name__}")
    return summary


def _read_metrics(path: Path, notes: list[str]) -> tuple[list[dict], list[dict]]:
    file = path / rundir.METRICS
    if not file.is_file():
        notes.append(f"no {rundir.METRICS}: no loss curve")
        return [], []
    train, evals, bad = [], [], []
    for n, line in enumerate(file.read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            bad.append(n)
            continue
        if not isinstance(record, dict):
            bad.append(n)
        elif record.get("kind") == "train" and _number(record.get("loss"), float) is not None:
            train.append(record)
        elif record.get("kind") == "eval":
            evals.append(record)
    if bad:
        notes.append(f"{rundir.METRICS}: skipped unreadable line(s) {', '.join(map(str, bad[:5]))}")
    return train, evals


def read_run(path: str | Path, label: str | None = None) -> RunRow:
    """Read one run directory; raises CompareError when it is not a finished lorakit run."""
    path = Path(path).expanduser()
    summary = _read_summary(path)
    row = RunRow(path=path.resolve(), label=label or path.resolve().name)
    row.method = summary.get("method") if isinstance(summary.get("method"), str) else None
    options = summary.get("method_options")
    if isinstance(options, list):
        row.method_options = [str(o) for o in options]
    row.model = summary.get("model") if isinstance(summary.get("model"), str) else None
    row.dtype = summary.get("dtype") if isinstance(summary.get("dtype"), str) else None
    quant = summary.get("quantization")
    if isinstance(quant, dict) and isinstance(quant.get("type"), str):
        row.quantization = quant["type"]
    for name in ("world_size", "zero_stage", "trainable_params", "total_params", "steps", "train_tokens"):
        setattr(row, name, _number(summary.get(name), int))
    row.tokens_per_second = _number(summary.get("tokens_per_second"), float)
    row.train_seconds = _number(summary.get("train_seconds"), float)
    memory = summary.get("peak_memory_bytes")
    if isinstance(memory, dict):
        row.peak_gpu_bytes = _number(memory.get("gpu"), int)
        row.peak_cpu_rss_bytes = _number(memory.get("cpu_rss"), int)
        row.device = "gpu" if row.peak_gpu_bytes is not None else "cpu"
    loss = summary.get("loss")
    if isinstance(loss, dict):
        row.loss_first = _number(loss.get("first"), float)
        row.loss_last = _number(loss.get("last"), float)
    ev = summary.get("eval")
    if isinstance(ev, dict):
        row.eval = {k: float(v) for k, v in ev.items() if _number(v, float) is not None}
    row.train_records, row.eval_records = _read_metrics(path, row.notes)
    row.objective_metrics = m if isinstance(m := summary.get("objective_metrics"), dict) else None
    if not row.eval and row.eval_records:
        # An older summary without the eval block: the last eval record holds the same numbers.
        last = row.eval_records[-1]
        row.eval = {
            k: float(v)
            for k, v in last.items()
            if k not in ("kind", "step", "epoch") and _number(v, float) is not None
        }
    spec = objective_of(row, summary.get("objective"))
    row.objective, row.loss_label = spec.name, spec.loss_label
    if spec.loss_label is not None:
        row.eval = {(loss_name(spec) if k == "loss" else k): v for k, v in row.eval.items()}
    return row


def loss_name(spec: ObjectiveSpec) -> str:
    """The eval metric an objective's loss is shown as: `loss` (SFT's token cross-entropy), else `TAG loss`
    (`dpo loss`), so losses of different objectives are never one column."""
    return "loss" if spec.loss_label is None else f"{spec.loss_label} loss"


def objective_of(row: RunRow, recorded: Any = None) -> ObjectiveSpec:
    """The objective a run trained: `recorded`, summary.json's `objective` (its registered spec; one this
    process does not know is tagged with its own name, its loss kept apart from any other). A summary from
    before that key: recognised by the metrics of its own its records carry (an ORPO run, reporting DPO's,
    reads as DPO), SFT when they carry none of any registered objective's."""
    if isinstance(recorded, str):
        known = {spec.name: spec for spec in specs()}
        return known.get(recorded) or ObjectiveSpec(name=recorded, loss_label=recorded)
    for spec in specs():
        key = spec.eval_metrics[0] if spec.eval_metrics else None
        if key is not None and (key in row.eval or any(key in r for r in row.train_records)):
            return spec
    return SFT


def unique_labels(paths: list[Path]) -> list[str]:
    """The shortest trailing path parts that tell the runs apart: `lora`, or `a/lora` and `b/lora`."""
    parts = [p.resolve().parts for p in paths]
    depth = 1
    while depth < max(len(p) for p in parts):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
        depth += 1
    return [str(p.resolve()) for p in paths]


def read_runs(run_dirs: list[str | Path]) -> list[RunRow]:
    """Read every run (all are checked before anything is written); labels are unique."""
    if isinstance(run_dirs, (str, Path)):
        run_dirs = [run_dirs]
    paths = [Path(p).expanduser() for p in run_dirs]
    if not paths:
        raise CompareError("give at least one run directory")
    seen: dict[Path, Path] = {}
    for p in paths:
        key = p.resolve()
        if key in seen:
            raise CompareError(f"{p}: given twice (as {seen[key]} too)")
        seen[key] = p
    return [read_run(p, label) for p, label in zip(paths, unique_labels(paths), strict=True)]
