"""Weights & Biases: the run's metric records in a W&B run, offline unless the user says otherwise.

wandb is the optional extra `lorakit[wandb]`, imported here only, when the sink is made (rank 0).
"""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from typing import Any

from lorakit.observe.records import scalars

# The x-axis of every W&B chart: the optimizer step, logged as a value rather than as wandb's own step,
# which must only grow and so would drop what a resumed run logs again after its checkpoint.
STEP = "step"


def logged_in() -> bool:
    """Whether this machine has W&B credentials (WANDB_API_KEY, or `wandb login`'s ~/.netrc entry)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def default_mode() -> str | None:
    """wandb.init's mode: None (wandb reads WANDB_MODE itself) when WANDB_MODE is set; else online with
    credentials, offline without, so a run never stops to ask for a login."""
    if os.environ.get("WANDB_MODE"):
        return None
    return "online" if logged_in() else "offline"


class WandbSink:
    """Logs every record's numbers (`kind/name`, with `step`) to one W&B run.

    `run_id`: the run to continue (a resumed lorakit run), else a new one. `config`: the resolved recipe.
    Offline runs are written under `directory`/wandb (`wandb sync DIR/wandb/offline-run-*` uploads them).
    """

    def __init__(
        self,
        directory: Path,
        name: str,
        *,
        run_id: str | None,
        config: dict[str, Any],
        init_timeout: float | None = None,
    ):
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        kwargs: dict[str, Any] = {}
        limits: dict[str, Any] = {}
        if init_timeout is not None:
            # wandb.init waits 90 s for an unreachable server by default; it gives up with the caller.
            limits["init_timeout"] = init_timeout
        if not os.environ.get("WANDB_PROJECT"):
            kwargs["project"] = "lorakit"
        self.run = wandb.init(
            dir=str(directory),
            name=name,
            id=run_id,
            resume="allow" if run_id else None,
            mode=default_mode(),
            config=config,
            # No stdout capture (lorakit prints progress itself) and no system-metrics thread.
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True, **limits),
            **kwargs,
        )
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP)

    @property
    def run_id(self) -> str:
        """The W&B run id (kept in trackers.json so a resumed run continues it)."""
        return self.run.id

    def describe(self) -> dict[str, Any]:
        """Where the run went, for summary.json."""
        # run.dir is the run's files/ directory; `wandb sync` takes the run directory above it.
        return {"id": self.run.id, "mode": self.run.settings.mode, "dir": str(Path(self.run.dir).parent)}

    def write(self, record: dict[str, Any]) -> None:
        """Log the record's scalars with their step."""
        step, values = scalars(record)
        self.run.log({STEP: step, **values})

    def close(self) -> None:
        """Finish the run (an offline run's files are complete after this)."""
        self.run.finish()
