"""The ZeRO-3 save contract on this machine's devices: a short run of a small model of the recipe's
architecture under ZeRO-3 on N processes saves its adapter, and the saved adapter is whole (every matrix
at its full shape, finite, trained) and reloads onto the base with an effect on its logits."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from lorakit.doctor.result import CheckResult, failed, passed, skipped

SECTION = "contracts"
NAME = "ZeRO-3 save + reload"


def _small_recipe(recipe, kind: str, processes: int, out: Path):
    """A 2-step ZeRO-3 run of tiny:KIND on the builtin news data, with the recipe's dtype, attention,
    packing and method."""
    from lorakit.model.families import family_named
    from lorakit.recipe import recipe_from_dict

    enc_dec = family_named(kind).encoder_decoder
    data = {
        "source": "builtin:news_summaries",
        "input_column": "article",
        "target_column": "highlights",
        "prompt_template": "Summarize:\n{input}\nSummary:\n",
        "max_samples": 16,  # 512 tokens keep every summary whole: rows with no loss tokens train nothing
        "eval_split": None,
        "cache_dir": recipe.data.cache_dir,
        **({"max_source_length": 64, "max_target_length": 16} if enc_dec else {"max_length": 512}),
    }
    if not enc_dec:
        data.update(format="instruction", packing=recipe.data.packing)
    method = recipe.method.model_dump(exclude_defaults=True) | {"dropout": 0.0}
    raw = {
        "model": {
            "name_or_path": f"tiny:{kind}",
            "dtype": recipe.model.dtype,
            "attention": recipe.model.attention,
            "gradient_checkpointing": False,
        },  # fmt: skip
        "method": method,
        "data": data,
        "train": {"max_steps": 2, "lr": 1e-2, "micro_batch_size": 2, "warmup_ratio": 0.0},
        "distributed": {"num_processes": processes, "zero_stage": 3, "backend": recipe.distributed.backend},
        "eval": {"enabled": False},
        "checkpoint": {"at_epoch_end": False},
        "output": {"dir": str(out), "report_to": []},
    }
    return recipe_from_dict(raw)


def _train(small, path: Path) -> dict:
    """Train `small` as a user would, with `python -m lorakit.run` (the doctor sits below the API that
    lorakit.train is); return its summary. A failed run raises with the run's last lines."""
    from lorakit.recipe import dump_recipe
    from lorakit.rundir import read_summary

    path.write_text(dump_recipe(small))
    proc = subprocess.run([sys.executable, "-m", "lorakit.run", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
        raise RuntimeError(f"`python -m lorakit.run` of the small run exited {proc.returncode}:\n{tail}")
    return read_summary(Path(small.output.dir))


def zero3_save(recipe, processes: int, *, quick: bool) -> CheckResult:
    """Train 2 steps under ZeRO-3 on `processes` processes, then read the adapter back and reload it."""
    from lorakit.doctor.models import recipe_config, small_kind
    from lorakit.engine.launch import launched_distributed

    if processes < 2:
        return skipped(SECTION, NAME, "one device: ZeRO-3 partitions nothing (on CPU: --devices 2)")
    if quick:
        return skipped(SECTION, NAME, "--quick")
    if launched_distributed():
        return skipped(
            SECTION, NAME, "inside a launched group: run the doctor outside the launcher for this check"
        )
    if not recipe.method.adapter() or recipe.method.kind != "lora":
        return skipped(SECTION, NAME, f"method.kind {recipe.method.kind}: the check saves a LoRA adapter")
    kind = small_kind(recipe_config(recipe))
    if kind is None:
        return skipped(
            SECTION, NAME, f"{recipe_config(recipe).model_type}: the check trains lorakit's tiny models only"
        )
    from lorakit.errors import AdapterError
    from lorakit.export.adapter import check_fits, read_adapter

    with tempfile.TemporaryDirectory(prefix="lorakit-doctor-zero3-") as tmp:
        small = _small_recipe(recipe, kind, processes, Path(tmp) / "run")
        summary = _train(small, Path(tmp) / "recipe.yaml")
        adapter_dir = Path(summary["adapter_dir"])
        try:
            adapter = read_adapter(adapter_dir)
            base, effect = _reload(small, adapter_dir, adapter, check_fits)
        except AdapterError as e:
            return failed(
                SECTION,
                NAME,
                f"the adapter saved under ZeRO-3 by {processes} processes: {e}",
                "ZeRO-3 did not gather the whole adapter before saving: the run's adapter/ would be unusable",
                "report doctor.md (DeepSpeed and peft versions); meanwhile train with distributed.zero_stage: 2",
            )
    detail = (
        f"{processes} processes, {len(adapter.pairs)} LoRA pairs saved whole and reloaded onto {base}; the "
        f"adapter moves its logits by up to {effect:.3g}"
    )
    if effect > 0:
        return passed(SECTION, NAME, detail, processes=processes, pairs=len(adapter.pairs), effect=effect)
    return failed(
        SECTION,
        NAME,
        detail,
        "the adapter reloaded but changes nothing: its trained values were lost in the ZeRO-3 save",
        "report doctor.md; meanwhile train with distributed.zero_stage: 2",
    )


def _reload(small, adapter_dir: Path, adapter, check_fits) -> tuple[str, float]:
    """Load the tiny base (no ZeRO), check the adapter fits it, attach it with peft; returns the base's
    source and the adapter's largest effect on the probe logits."""
    from peft import PeftModel

    from lorakit.export.verify import max_diff, probe_batch, probe_logits
    from lorakit.model import build_model

    base = build_model(small.model_copy(update={"method": small.method.model_copy(update={"kind": "full"})}))
    check_fits(adapter, base.model, base.source)
    batch = probe_batch(base.model.config, base.model.config.vocab_size)
    plain = probe_logits(base.model, batch)
    with_adapter = probe_logits(PeftModel.from_pretrained(base.model, str(adapter_dir)), batch)
    return small.model.name_or_path, max_diff(with_adapter, plain)
