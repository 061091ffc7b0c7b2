"""TensorBoard: the run's metric records as scalars in output.dir/tensorboard (`tensorboard --logdir`).

torch.utils.tensorboard's SummaryWriter needs the `tensorboard` package, a core dependency of lorakit
because tensorboard is output.report_to's default; it is imported here only, when the sink is made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lorakit.observe.records import flat_params, scalars


class TensorBoardSink:
    """Writes every record's numbers as scalars `kind/name` at the record's step.

    `purge_step` (a resumed run: the checkpoint's step + 1): TensorBoard hides what this directory holds at
    that step and after, i.e. what an interrupted run logged after its checkpoint, so the resumed run's
    steps are neither duplicated nor out of order. `params` (a fresh run): the resolved recipe, shown in the
    HParams tab and, as YAML, in the Text tab.
    """

    def __init__(
        self,
        log_dir: Path,
        *,
        purge_step: int | None = None,
        params: dict[str, Any] | None = None,
        recipe_yaml: str | None = None,
    ):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)
        if params is not None:
            # add_hparams would write a run of its own in a subdirectory; these three summaries in this
            # run's file attach the parameters to the run that holds the curves.
            experiment, start, end = hparams(flat_params(params), {})
            writer = self.writer._get_file_writer()
            for summary in (experiment, start, end):
                writer.add_summary(summary)
        if recipe_yaml is not None:
            # Indented four spaces: TensorBoard renders text as Markdown, which would reflow plain YAML.
            self.writer.add_text("recipe", "".join(f"    {line}\n" for line in recipe_yaml.splitlines()))
        self.writer.flush()

    def describe(self) -> dict[str, Any]:
        """Where the records go, for summary.json."""
        return {"log_dir": str(self.log_dir)}

    def write(self, record: dict[str, Any]) -> None:
        """Add the record's scalars and flush, so a run killed outright loses no step it logged."""
        step, values = scalars(record)
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()
