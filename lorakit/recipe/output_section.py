"""The recipe's output and preflight sections: the run directory, what is published, checks before training."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from lorakit.recipe.section import Section

# A Hub repository id: OWNER/NAME (what the Hub accepts for both parts, without its length limits).
REPO_ID_PATTERN = r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$"


class PushToHubSection(Section):
    """output.push_to_hub: where the trained model goes on the Hugging Face Hub (docs/publish.md)."""

    repo_id: str = Field(
        pattern=REPO_ID_PATTERN,
        description="The model repository, OWNER/NAME (your user or organization name); created when it "
        "does not exist.",
    )
    private: bool = Field(
        False, description="Create the repository private (an existing repository keeps its visibility)."
    )
    revision: str | None = Field(
        None, description="Branch to commit to, created when missing; null: main.", min_length=1
    )
    create_pr: bool = Field(
        False, description="Open a pull request with the commit instead of committing to the branch."
    )


class OutputSection(Section):
    """Where the run directory goes."""

    dir: str = Field(
        description="Run directory: recipe.yaml, ds_config.json, metrics.jsonl, summary.json, adapter/ "
        "(merged/ with output.merge)."
    )
    save_adapter: bool = Field(
        True, description="Save the trained adapter (LoRA) or model (full) at the end."
    )
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        ["tensorboard"],
        description="Where the metric records of metrics.jsonl also go (rank 0), with the resolved recipe as "
        "hyper-parameters: tensorboard (event files in output.dir/tensorboard), wandb (offline unless "
        'WANDB_MODE or a W&B login says otherwise; pip install "lorakit[wandb]"), mlflow (a file store in '
        'output.dir/mlruns unless MLFLOW_TRACKING_URI is set; pip install "lorakit[mlflow]"). []: only '
        "metrics.jsonl. See docs/observe.md.",
    )
    # issue 38: a tracker never stops training.
    tracker_timeout_seconds: float = Field(
        60.0,
        gt=0,
        description="How long rank 0 waits for a remote tracker (wandb, mlflow) to start before training "
        "goes on without it (a warning; summary.json lists it under trackers as failed); the records stay "
        "in metrics.jsonl. Also the longest a run's end waits for a tracker to take its last records.",
    )
    merge: bool = Field(
        False,
        description="After saving, merge the adapter into the base (full runs: re-export the model) as "
        "sharded safetensors in run_dir/merged, in model.dtype, verified like `python -m lorakit.merge` "
        "(rank 0, in the training process); summary.json records merged_dir. See docs/merge.md.",
    )
    push_to_hub: PushToHubSection | None = Field(
        None,
        description="{repo_id: OWNER/NAME (required), private: false, revision: null (main; a branch is "
        "created when missing), create_pr: false}: at the end of a run whose every check passed "
        "(the merge's included), rank 0 pushes the adapter (or model), and the merged model with "
        "output.merge, to the Hugging Face Hub in one commit, with a model card, recipe.yaml and loss.png; "
        "the token comes from HF_TOKEN or `hf auth login`, checked before training. A failed push leaves the "
        "run complete (exit code 69; push it again with `python -m lorakit.push`). See docs/publish.md.",
    )

    @model_validator(mode="after")
    def _check(self) -> OutputSection:
        if len(set(self.report_to)) != len(self.report_to):
            raise ValueError(f"output.report_to names a backend twice: {self.report_to}")
        if self.merge and not self.save_adapter:
            raise ValueError(
                "output.merge needs output.save_adapter: true (the merge reads the saved adapter or model)"
            )
        if self.push_to_hub is not None and not self.save_adapter:
            raise ValueError(
                "output.push_to_hub needs output.save_adapter: true (the push uploads the saved adapter or model)"
            )
        return self


class PreflightSection(Section):
    """Checks of the machine before training starts. See docs/doctor.md."""

    doctor: bool = Field(
        False,
        description="Run `python -m lorakit.doctor RECIPE --quick` before training (in the launching process, "
        "after the run lock is taken): the environment, the packing / loss / merge / accumulation contracts "
        "on a small model of the recipe's architecture with its kernels and dtype, one block's speed and the "
        "memory plan. Its report goes to output.dir/doctor; a failed check stops the run (exit code 3) "
        "before the training model is loaded. Under a launcher other than lorakit's (torchrun, the deepspeed "
        "launcher) it does not run: run the doctor before launching.",
    )
