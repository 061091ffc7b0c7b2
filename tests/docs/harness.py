"""The doc-test harness: every command and code block in README.md and docs/*.md runs, or says why not.

The convention (docs/contributing.md explains it to authors):

- A fenced ```bash or ```python block runs on CPU. The blocks of one page run in order, in one temporary
  directory that holds a copy of the repository's recipes/ as ./recipes, so a later block may use what an
  earlier one wrote. bash blocks run with `bash -euo pipefail`; python blocks with the interpreter running
  the tests (test_docs.py serves it, and `python` in a bash block, from a fork server that has imported
  torch, transformers and lorakit once: see zygote.py). A bash block whose lines start with `$ ` is a
  transcript: only those lines run (without the `$ `), the others are the output they print and are not
  checked. Comment lines are ordinary bash comments.
- `<!-- doc-test: skip REASON -->` on the line immediately before the fence: the block is not run. The
  reason is required ("needs 8 GPUs and the hub", "multi-node").
- `<!-- doc-test: covered-by TARGET -->`: the block is not run here because TARGET already runs it, and the
  harness checks that claim. TARGET is a test, `tests/PATH.py::NAME` (the test function must exist and the
  file must run each command of the block: the command verbatim, or the same `python -m` module with the
  same recipe files and --options), or a script such as `.ci/run` (each command of the block must be one of
  its lines, ignoring `python -m` before pip or pytest and -q/--quiet).
- ```yaml, ```text, ```json (any other language) are shown, not run. A fence with no language, or one that
  looks runnable but is not bash/python (sh, shell, console, py, ...), is an error: tag it so it is clear
  whether it runs. An indented code block may show a synopsis (placeholders in CAPITALS, `[...]`), never a
  real command: a command that users type belongs in a fenced bash block.

Blocks run with a HOME shared by every page of the session (so the tiny models under ~/.cache/lorakit are
built once), the repository first on PYTHONPATH (the docs test this checkout), the interpreter's directory
first on PATH (so `python` is the interpreter running the tests), no network (HF_HUB_OFFLINE), and one
OpenMP thread per process unless OMP_NUM_THREADS is set (two pages run at once on a 2-core machine; torchrun
sets the same for its workers).
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

RUN_LANGS = ("bash", "python")
# Languages that look runnable but would silently not run: the author meant bash or python.
AMBIGUOUS_LANGS = {"", "sh", "shell", "zsh", "console", "shell-session", "py", "python3", "pycon", "ipython"}
DIRECTIVE = re.compile(r"^\s*<!--\s*doc-test:\s*(?P<body>.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
COMMAND_WORDS = ("python ", "python3 ", "pip ", "torchrun ", "deepspeed ", "accelerate ", "$ ")

DEFAULT_TIMEOUT_S = 300
OUTPUT_TAIL = 4000


class DocTestError(Exception):
    """A page breaks the convention (a bad marker, an untagged fence, a false covered-by claim)."""


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language, its text, and its doc-test marker if any."""

    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None = None
    covered_by: str | None = None

    @property
    def where(self) -> str:
        return f"{rel(self.page)}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.lang in RUN_LANGS and self.skip is None and self.covered_by is None


@dataclass
class BlockResult:
    """What running one block gave."""

    block: Block
    returncode: int
    output: str
    seconds: float
    timed_out: bool = False


@dataclass
class PageResult:
    """The blocks of one page and what each run gave; `failed` is the first block that did not pass."""

    page: Path
    blocks: list[Block]
    results: list[BlockResult] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> BlockResult | None:
        return next((r for r in self.results if r.returncode != 0), None)

    def report(self) -> str:
        """The failure message: page, line, the block, the command's output."""
        lines = [f"{rel(self.page)}: {p}" for p in self.problems]
        bad = self.failed
        if bad is not None:
            why = f"timed out after {bad.seconds:.0f} s" if bad.timed_out else f"exit code {bad.returncode}"
            tail = bad.output[-OUTPUT_TAIL:]
            lines += [
                f"{bad.block.where}: ```{bad.block.lang} block failed ({why}):",
                _indent(bad.block.code),
                "output" + (" (last part)" if len(bad.output) > OUTPUT_TAIL else "") + ":",
                _indent(tail),
            ]
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: blocks run, skipped, covered elsewhere, and the time taken (each block's too)."""
        ran = len(self.results)
        skipped = sum(b.skip is not None for b in self.blocks)
        covered = sum(b.covered_by is not None for b in self.blocks)
        times = ", ".join(f"L{r.block.line} {r.seconds:.0f} s" for r in self.results)
        return (
            f"{rel(self.page)}: {ran} blocks run, {skipped} skipped, {covered} covered by other tests, "
            f"{self.seconds:.0f} s" + (f" ({times})" if times else "")
        )


def rel(path: Path) -> str:
    """`path` relative to the repository when it is inside it (the name a failure message shows)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.rstrip("\n").splitlines())


def discover_pages(root: Path = ROOT) -> list[Path]:
    """README.md and every docs/*.md, in a stable order."""
    pages = [root / "README.md"] if (root / "README.md").is_file() else []
    return pages + sorted((root / "docs").glob("*.md"))


def parse_page(page: Path) -> list[Block]:
    """Every fenced block of a Markdown page, with its marker; DocTestError for a page that breaks the
    convention (all its problems in one message)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    pending: tuple[int, str, str] | None = None  # (line, kind, argument) of a marker awaiting its fence
    i = 0
    while i < len(lines):
        line = lines[i]
        directive = DIRECTIVE.match(line)
        fence = FENCE.match(line)
        if pending is not None and not fence:
            problems.append(f"line {pending[0]}: doc-test marker not immediately followed by a code fence")
            pending = None
        if directive:
            parsed = _parse_directive(directive["body"])
            if isinstance(parsed, str):
                problems.append(f"line {i + 1}: {parsed}")
            else:
                pending = (i + 1, *parsed)
            i += 1
            continue
        if not fence:
            i += 1
            continue
        indent, marker = len(fence["indent"]), fence["fence"]
        lang = fence["info"].strip().split(" ")[0].lower() if fence["info"].strip() else ""
        body, j = [], i + 1
        while j < len(lines):
            close = re.match(r"^\s*(`{3,}|~{3,})\s*$", lines[j])
            if close and close[1][0] == marker[0] and len(close[1]) >= len(marker):
                break
            text = lines[j]
            # Inside a list item the block is indented with it: remove that indentation, as Markdown does.
            body.append(text[indent:] if text[:indent].strip() == "" else text.lstrip())
            j += 1
        if j == len(lines):
            problems.append(f"line {i + 1}: code fence never closed")
        kind, arg = (pending[1], pending[2]) if pending else (None, None)
        if lang in AMBIGUOUS_LANGS:
            tag = f"```{lang}" if lang else "a fence without a language"
            problems.append(
                f"line {i + 1}: {tag}: use ```bash or ```python (run) or ```text (shown, not run)"
            )
        elif pending is not None and lang not in RUN_LANGS:
            problems.append(f"line {pending[0]}: doc-test marker before a ```{lang} block, which never runs")
        blocks.append(
            Block(
                page=page,
                line=i + 1,
                lang=lang,
                code="\n".join(body) + "\n",
                skip=arg if kind == "skip" else None,
                covered_by=arg if kind == "covered-by" else None,
            )
        )
        pending = None
        i = j + 1
    if pending is not None:
        problems.append(f"line {pending[0]}: doc-test marker not immediately followed by a code fence")
    problems += [f"line {n}: {msg}" for n, msg in indented_commands(lines)]
    if problems:
        raise DocTestError("\n".join(problems))
    return blocks


def _parse_directive(body: str) -> tuple[str, str] | str:
    """(kind, argument) of a marker's body, or the reason it is malformed."""
    kind, _, arg = body.partition(" ")
    arg = arg.strip()
    if kind == "skip":
        return (
            ("skip", arg)
            if arg
            else "doc-test: skip needs a reason, e.g. <!-- doc-test: skip needs 8 GPUs -->"
        )
    if kind == "covered-by":
        return (
            ("covered-by", arg)
            if arg
            else "doc-test: covered-by needs a target (tests/X.py::NAME or a script)"
        )
    return f"unknown doc-test marker {body!r}: use `skip REASON` or `covered-by TARGET`"


def indented_commands(lines: list[str]) -> list[tuple[int, str]]:
    """Commands in 4-space indented code blocks (outside fences), which the harness cannot run: a synopsis
    with CAPITAL placeholders, [options] or ... is allowed, a real command is not."""
    found = []
    in_fence = False
    prev_blank = True
    in_block = False
    for n, line in enumerate(lines, 1):
        if re.match(r"^\s*(`{3,}|~{3,})", line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        if (
            line.startswith("    ")
            and (prev_blank or in_block)
            and not re.match(r"^\s*([-*+]|\d+\.)\s", line)
        ):
            in_block = True
            text = line.strip()
            if text.startswith(COMMAND_WORDS) and not _is_synopsis(text):
                found.append(
                    (n, f"a command in an indented code block: put it in a fenced ```bash block: {text}")
                )
        elif line.strip():
            in_block = False
        prev_blank = not line.strip()
    return found


def _is_synopsis(text: str) -> bool:
    command = text.split("#", 1)[0]
    return "..." in command or "[" in command or bool(re.search(r"\b[A-Z][A-Z_]{2,}\b", command))


# ---------------------------------------------------------------------------------------------------------
# covered-by


def command_lines(block: Block) -> list[str]:
    """The commands of a bash block: its transcript lines (`$ `) if it has any, else every non-comment line."""
    lines = [ln.strip() for ln in block.code.splitlines()]
    if any(ln.startswith("$ ") for ln in lines):
        lines = [ln[2:].strip() for ln in lines if ln.startswith("$ ")]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def _tokens(line: str) -> list[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError:
        return line.split()


def _normalized(tokens: list[str]) -> list[str]:
    """`python -m pip install -q X` and `pip install X` are the same command."""
    if len(tokens) >= 3 and re.fullmatch(r"python3?", tokens[0]) and tokens[1] == "-m":
        tokens = tokens[2:]
    return [t for t in tokens if t not in ("-q", "--quiet")]


def check_covered(block: Block, root: Path = ROOT) -> None:
    """Raise DocTestError unless `block.covered_by` really runs the block's commands."""
    target = block.covered_by
    assert target is not None
    if block.lang != "bash":
        raise DocTestError(f"{block.where}: covered-by applies to bash commands, not a ```{block.lang} block")
    path_text, _, test = target.partition("::")
    path = root / path_text
    if not path.is_file():
        raise DocTestError(f"{block.where}: covered-by {target}: no file {path_text}")
    text = path.read_text(encoding="utf-8")
    commands = command_lines(block)
    if not commands:
        raise DocTestError(f"{block.where}: covered-by on a block with no command")
    if test:
        if not _has_test(text, test):
            raise DocTestError(f"{block.where}: covered-by {target}: no test {test} in {path_text}")
        missing = [c for c in commands if not _test_runs(text, c)]
    else:
        script = {tuple(_normalized(_tokens(ln))) for ln in text.splitlines()}
        missing = [c for c in commands if tuple(_normalized(_tokens(c))) not in script]
    if missing:
        raise DocTestError(
            f"{block.where}: covered-by {target}, but {path_text} does not run: " + "; ".join(missing)
        )


def _has_test(source: str, name: str) -> bool:
    """Whether `name` (`test_x` or `TestClass::test_x`) is defined at module level of a test file."""
    parts = name.split("::")
    body = ast.parse(source).body
    for part in parts:
        node = next(
            (
                n
                for n in body
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and n.name == part
            ),
            None,
        )
        if node is None:
            return False
        body = node.body
    return isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)


def _test_runs(source: str, command: str) -> bool:
    """The test file has the command verbatim, or runs the same module with the same recipes and options."""
    if command in source:
        return True
    tokens = _tokens(command)
    if len(tokens) < 3 or not re.fullmatch(r"python3?", tokens[0]) or tokens[1] != "-m":
        return False
    needed = [f'"{tokens[2]}"']
    needed += [Path(t).name for t in tokens[3:] if t.endswith((".yaml", ".yml"))]
    needed += [t.split("=", 1)[0] for t in tokens[3:] if t.startswith("--")]
    return all(n in source for n in needed)


# ---------------------------------------------------------------------------------------------------------
# running


def doc_env(home: Path, root: Path = ROOT) -> dict[str, str]:
    """The environment blocks run in (see the module docstring)."""
    env = dict(os.environ)
    # Building DeepSpeed's CPU ops takes minutes: keep them where this user already has them built.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    env["HOME"] = str(home)
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env["HF_HUB_OFFLINE"] = "1"
    env["HF_DATASETS_OFFLINE"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def prepare_workdir(workdir: Path, root: Path = ROOT) -> None:
    """The page's directory: a copy (not a link: a page must not write into the repository) of recipes/."""
    workdir.mkdir(parents=True, exist_ok=True)
    if (root / "recipes").is_dir():
        shutil.copytree(root / "recipes", workdir / "recipes", dirs_exist_ok=True)


def run_block(
    block: Block,
    workdir: Path,
    scripts: Path,
    env: dict[str, str],
    timeout: float,
    python: str = sys.executable,
) -> BlockResult:
    """Run one block in `workdir` (a python block with `python`); the script file is kept in `scripts`
    (outside the page's directory)."""
    scripts.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{block.page.name}-L{block.line}")
    if block.lang == "python":
        script = scripts / f"{stem}.py"
        script.write_text(block.code, encoding="utf-8")
        cmd = [python, str(script)]
    else:
        script = scripts / f"{stem}.sh"
        lines = block.code.splitlines()
        if any(ln.lstrip().startswith("$ ") for ln in lines):
            lines = [ln.lstrip()[2:] for ln in lines if ln.lstrip().startswith("$ ")]
        script.write_text("\n".join(lines) + "\n", encoding="utf-8")
        cmd = ["bash", "-euo", "pipefail", str(script)]
    start = time.monotonic()
    # A session of its own, so a timeout kills the whole tree (torchrun and its workers).
    proc = subprocess.Popen(
        cmd,
        cwd=workdir,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        timed_out = True
    returncode = proc.returncode if not timed_out else -signal.SIGKILL
    return BlockResult(block, returncode, output, time.monotonic() - start, timed_out)


def run_page(
    page: Path,
    workdir: Path,
    env: dict[str, str],
    timeout: float = DEFAULT_TIMEOUT_S,
    root: Path = ROOT,
    python: str = sys.executable,
) -> PageResult:
    """Check a page's markers and covered-by claims, then run its blocks in order in `workdir`, stopping at
    the first that fails (later blocks may need what it should have written)."""
    start = time.monotonic()
    try:
        blocks = parse_page(page)
    except DocTestError as e:
        return PageResult(page, [], problems=str(e).splitlines())
    result = PageResult(page, blocks)
    for block in blocks:
        if block.covered_by is not None:
            try:
                check_covered(block, root)
            except DocTestError as e:
                result.problems.append(str(e))
    if result.problems:
        return result
    prepare_workdir(workdir, root)
    scripts = workdir.parent / f".{workdir.name}-scripts"
    for block in blocks:
        if not block.runs:
            continue
        outcome = run_block(block, workdir, scripts, env, timeout, python)
        result.results.append(outcome)
        if outcome.returncode != 0:
            break
    result.seconds = time.monotonic() - start
    return result


def weight(page: Path) -> int:
    """A rough cost of a page (training runs first), so the slowest pages start first when run in parallel."""
    try:
        blocks = parse_page(page)
    except DocTestError:
        return 0
    runs = [b for b in blocks if b.runs]
    return sum(3 * len(re.findall(r"lorakit\.run|lorakit\.train\(|torchrun", b.code)) + 1 for b in runs)
