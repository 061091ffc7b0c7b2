"""What every doctor check returns (CheckResult) and the report they make (DoctorReport): the console
table, doctor.json and doctor.md."""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PASS, FAIL, SKIP = "pass", "fail", "skip"
SECTIONS = ("environment", "contracts", "speed", "plan")


@dataclass(frozen=True)
class CheckResult:
    """One check: what it measured (`detail`), and for a failure what it means and what to do."""

    section: str
    name: str
    status: str  # PASS, FAIL or SKIP (a skip says why in `detail`)
    detail: str
    meaning: str = ""
    action: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """True unless the check failed (a skip is not a failure)."""
        return self.status != FAIL

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def passed(section: str, name: str, detail: str, **data: Any) -> CheckResult:
    """A passing check."""
    return CheckResult(section, name, PASS, detail, data=data)


def failed(section: str, name: str, detail: str, meaning: str, action: str, **data: Any) -> CheckResult:
    """A failing check, with what it means and what to do."""
    return CheckResult(section, name, FAIL, detail, meaning, action, data=data)


def skipped(section: str, name: str, why: str, **data: Any) -> CheckResult:
    """A check that did not run here, and why."""
    return CheckResult(section, name, SKIP, why, data=data)


@dataclass
class DoctorReport:
    """Every check of one doctor run, with the machine and recipe it ran for."""

    recipe: str | None
    quick: bool
    checks: list[CheckResult]
    seconds: float = 0.0
    versions: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Whether every check passed (skips allowed): the command's exit code is 0 exactly then."""
        return all(c.passed for c in self.checks)

    @property
    def failures(self) -> list[CheckResult]:
        return [c for c in self.checks if not c.passed]

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "recipe": self.recipe,
            "quick": self.quick,
            "seconds": round(self.seconds, 2),
            "versions": self.versions,
            "checks": [c.to_dict() for c in self.checks],
        }

    def table(self, width: int = 110) -> str:
        """The console table: one line per check, then each failure's meaning and advice."""
        lines = []
        name_w = max([len(c.name) for c in self.checks] + [10])
        for section in SECTIONS:
            rows = [c for c in self.checks if c.section == section]
            if not rows:
                continue
            lines.append(section.upper())
            indent = " " * (name_w + 10)
            for c in rows:
                head = f"  {c.status.upper():<5} {c.name:<{name_w}}  "
                lines += textwrap.wrap(c.detail, width, initial_indent=head, subsequent_indent=indent) or [
                    head
                ]
        for c in self.failures:
            lines += ["", f"FAILED {c.section}/{c.name}: {c.detail}"]
            if c.meaning:
                lines.append(f"  means: {c.meaning}")
            if c.action:
                lines.append(f"  do:    {c.action}")
        verdict = "every check passed" if self.ok else f"{len(self.failures)} check(s) failed"
        lines += ["", f"doctor: {verdict} ({self.seconds:.1f} s{', quick' if self.quick else ''})"]
        return "\n".join(lines)

    def markdown(self) -> str:
        """doctor.md: the table and the versions, ready to paste into a bug report."""
        out = [
            "# lorakit doctor",
            "",
            f"Recipe: `{self.recipe or 'none'}`{' (--quick)' if self.quick else ''}. "
            + ("Every check passed." if self.ok else f"**{len(self.failures)} check(s) failed.**"),
            "",
            "| section | check | status | detail |",
            "| --- | --- | --- | --- |",
        ]
        for c in self.checks:
            out.append(f"| {c.section} | {c.name} | {c.status} | {_cell(c.detail)} |")
        for c in self.failures:
            out += ["", f"## Failed: {c.section}/{c.name}", "", c.detail, ""]
            if c.meaning:
                out.append(f"What it means: {c.meaning}")
            if c.action:
                out += ["", f"What to do: {c.action}"]
        out += ["", "## Versions", "", "```json", json.dumps(self.versions, indent=2), "```", ""]
        return "\n".join(out)

    def write(self, output: str | Path) -> tuple[Path, Path]:
        """Write doctor.json and doctor.md into `output` (created); returns their paths."""
        from lorakit import rundir

        out = Path(output).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        rundir.write_json(out / "doctor.json", self.to_dict())
        rundir.write_text(out / "doctor.md", self.markdown())
        return out / "doctor.json", out / "doctor.md"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
