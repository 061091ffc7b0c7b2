"""The job script python -m lorakit.slurm writes, against what a Slurm cluster expects of it: the node's
memory asked for (sized from the plan, all of it, or whole nodes), a warning for what is left to the
partition's defaults, a training step that ends every node when one fails, a rendezvous port outside
Linux's ephemeral range, GPUs as --gres where cons_tres is missing, and a plan header that says what it
assumes. Then every value that reaches the script, tried with hostile text (docs/faults.md#job-scripts)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lorakit.planner import plan
from lorakit.recipe import load_recipe
from lorakit.slurm.__main__ import main
from lorakit.slurm.script import JobSpec, render
from tests.conftest import RECIPES

RECIPE = str(RECIPES / "quickstart_causal.yaml")
SHAPE = ("--nodes", "2", "--gpus-per-node", "8")


def _write(tmp_path, *extra: str, out: str = "run") -> tuple[int, Path]:
    args = [RECIPE, f"output.dir={tmp_path / out}", f"data.cache_dir={tmp_path / 'cache'}", *extra]
    return main(args), tmp_path / out / "job.sbatch"


def _directives(text: str) -> list[list[str]]:
    """Each #SBATCH line's arguments, read as sbatch reads them (src/sbatch/opt.c, _get_argument): words
    split at whitespace, double or single quotes group, a backslash escapes the next character, and an
    unquoted # starts a comment."""
    out = []
    for line in text.split("\n"):
        if not line.startswith("#SBATCH"):
            continue
        words, word, quote, escaped, i, rest = [], None, None, False, 0, line[len("#SBATCH") :]
        while i < len(rest):
            c = rest[i]
            if escaped:
                word, escaped = (word or "") + c, False
            elif c == "\\":
                escaped, word = True, word or ""
            elif quote:
                if c == quote:
                    quote = None
                else:
                    word += c
            elif c in "\"'":
                quote, word = c, word or ""
            elif c == "#":
                break
            elif c.isspace():
                if word is not None:
                    words.append(word)
                word = None
            else:
                word = (word or "") + c
            i += 1
        assert quote is None, f"an #SBATCH line ends inside quotes: {line!r}"
        if word is not None:
            words.append(word)
        out.append(words)
    return out


def _options(text: str) -> dict[str, str]:
    found = {}
    for words in _directives(text):
        assert len(words) == 1, words  # one option per line, never split by a value
        key, _, value = words[0].partition("=")
        found[key] = value
    return found


def test_the_job_asks_for_the_nodes_memory_sized_from_its_plan(tmp_path, capsys):
    code, script = _write(tmp_path, *SHAPE, "--time", "1:00:00", "--cpus-per-task", "32")
    assert code == 0
    recipe = load_recipe(RECIPE, [f"data.cache_dir={tmp_path / 'cache'}", "distributed.num_processes=8"])
    need = plan(recipe, gpus=8, nodes=2).per_node_cpu_bytes
    options = _options(script.read_text())
    mem = options["--mem"]
    assert mem.endswith("G") and need <= int(mem[:-1]) * 2**30 <= 1.5 * need + 2**30, (mem, need)
    assert "--exclusive" not in options
    assert capsys.readouterr().err == ""  # time, CPUs and memory given or sized: nothing to warn about


@pytest.mark.parametrize(
    ("extra", "mem", "exclusive"),
    [(("--exclusive",), "0", True), (("--mem", "500G"), "500G", False), (("--mem", "0"), "0", False)],
)
def test_whole_nodes_or_a_given_memory(tmp_path, extra, mem, exclusive):
    code, script = _write(tmp_path, *SHAPE, "--time", "1:00:00", "--cpus-per-task", "32", *extra)
    assert code == 0
    options = _options(script.read_text())
    assert options["--mem"] == mem and ("--exclusive" in options) == exclusive


def test_a_memory_slurm_cannot_read_is_exit_2(tmp_path, capsys):
    code, script = _write(tmp_path, *SHAPE, "--mem", "24 GB")
    assert code == 2 and "--mem: expected Slurm's memory per node" in capsys.readouterr().err
    assert not script.parent.exists()


def test_what_is_left_to_the_partitions_defaults_is_warned_about(tmp_path, capsys):
    code, script = _write(tmp_path, *SHAPE)
    captured = capsys.readouterr()
    assert code == 0 and captured.out.strip() == str(script)  # the path alone: scripts read it
    warnings = captured.err.splitlines()
    assert [w.split(":")[1].strip() for w in warnings] == ["no --time", "no --cpus-per-task"], warnings
    assert all(w.startswith("warning: ") for w in warnings)


def test_the_training_step_ends_every_node_when_one_fails(tmp_path):
    code, script = _write(tmp_path, *SHAPE, "--time", "1:00:00", "--cpus-per-task", "32")
    steps = [line for line in script.read_text().split("\n") if line.startswith("srun ")]
    assert len(steps) == 2 and all("--kill-on-bad-exit=1" in step.split() for step in steps), steps


def test_the_rendezvous_port_is_outside_linuxs_ephemeral_range_and_differs_by_job(tmp_path):
    code, script = _write(tmp_path, *SHAPE, "--time", "1:00:00", "--cpus-per-task", "32")
    (line,) = [line for line in script.read_text().split("\n") if line.startswith("PORT=")]
    ids = [1, 2, 12_345, 32_767 - 20_000, 32_768 - 20_000, 999_999, 4_294_967_294, *range(50_000, 50_200)]
    probe = "".join(f"SLURM_JOB_ID={i}; {line}; echo $PORT\n" for i in ids)
    ports = [
        int(p) for p in subprocess.run(["bash", "-c", probe], capture_output=True, text=True).stdout.split()
    ]
    assert len(ports) == len(ids)
    assert all(1024 <= p < 32768 for p in ports), [p for p in ports if not 1024 <= p < 32768]
    assert len(set(ports[-200:])) == 200  # neighbouring jobs (sharing a node) get their own ports
    chosen = subprocess.run(["bash", "-c", f"MASTER_PORT=29511; SLURM_JOB_ID=7; {line}; echo $PORT"],
                            capture_output=True, text=True).stdout  # fmt: skip
    assert chosen.strip() == "29511"


@pytest.mark.parametrize("gres", [False, True])
def test_gpus_are_asked_for_as_gres_where_cons_tres_is_missing(tmp_path, gres):
    extra = ("--gres",) if gres else ()
    code, script = _write(tmp_path, *SHAPE, "--time", "1:00:00", "--cpus-per-task", "32", *extra)
    text = script.read_text()
    options = _options(text)
    asked, other = ("--gres", "--gpus-per-node") if gres else ("--gpus-per-node", "--gres")
    assert options[asked] == ("gpu:8" if gres else "8") and other not in options
    # The other way is next to it, as a comment: one edit for a cluster that needs it.
    assert re.search(rf"^# #SBATCH {other}=(gpu:)?8 ", text, re.M), text


def test_the_plan_header_says_what_it_assumes_not_what_this_machine_has(tmp_path):
    code, script = _write(tmp_path, *SHAPE, "--time", "1:00:00", "--cpus-per-task", "32")
    text = script.read_text()
    assert "not what this machine has installed" in text
    (hardware,) = [line for line in text.split("\n") if line.startswith("# hardware: ")]
    # model.attention auto: the nodes choose flash_attention_2 where it is installed, SDPA elsewhere.
    assert "attention: sdpa or flash_attention_2 (model.attention auto" in hardware, hardware


# Text that ends a comment, a quoted word or a line, or runs code where a shell evaluates it.
HOSTILE = [
    "a\nb", "a\rb", "a\tb", "a\u2028b", "a\u2029b", "a\x85b", "a'b", 'a"b', "a\\b", "a # b",
    "$(touch PWNED)", "`touch PWNED`", "a;touch PWNED", "a%jb",
]  # fmt: skip
# Every value that reaches the script, and what an exit code 2 names when the value is refused.
FIELDS = ["output.dir", "override", "recipe", "workdir", "python", "--partition", "--account", "--time",
          "--mem", "--gpu-memory"]  # fmt: skip


def _standins(bin_dir: Path, record: Path) -> None:
    """srun (records its arguments: each ended by NUL, each call by \\x01) and scontrol (one node)."""
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        f"#!/bin/bash\n{{ printf '%s\\0' \"$@\"; printf '\\1'; }} >> {shlex.quote(str(record))}\n"
    )
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node1\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)


@pytest.mark.parametrize("field", FIELDS)
def test_every_value_that_reaches_the_script_is_refused_or_quoted(tmp_path, monkeypatch, capsys, field):
    python = sys.executable
    base = tmp_path / "base"
    base.mkdir()
    for n, hostile in enumerate(HOSTILE):
        case = base / str(n)
        case.mkdir()
        run_dir, recipe, options = case / "run", RECIPE, []
        overrides = [f"data.cache_dir={tmp_path / 'cache'}"]
        monkeypatch.chdir(case)
        if field == "output.dir":
            run_dir = case / f"run{hostile}"
        elif field == "override":
            overrides.append(f"data.prompt_template=Summarize{hostile}{{input}}")
        elif field == "recipe":
            recipe = str(case / f"recipe{hostile}.yaml")
            shutil.copy(RECIPE, recipe)
        elif field == "workdir":
            workdir = case / f"wd{hostile}"
            workdir.mkdir()
            monkeypatch.chdir(workdir)
        elif field == "python":
            monkeypatch.setattr(sys, "executable", f"/opt/py{hostile}/python")
        else:
            options = [field, hostile]
        overrides.append(f"output.dir={run_dir}")
        # Overrides are YAML values (a plain scalar's line break folds to a space): the folder the job uses.
        run_dir = Path(load_recipe(RECIPE, overrides[-1:]).output.dir).resolve()
        code = main([recipe, *overrides, *SHAPE, "--cpus-per-task", "8", *options])
        monkeypatch.setattr(sys, "executable", python)
        err = capsys.readouterr().err
        script = run_dir / "job.sbatch"
        if code == 2:
            # An override is a YAML value ("a # b" ends at its comment): the recipe's own check may name it.
            named = "data.prompt_template" if field == "override" else field
            assert err.startswith(f"error: {named}") or f"  {named} " in err, (hostile, err)
            assert not script.exists() and not run_dir.exists(), hostile
            continue
        assert code == 0, (hostile, err)
        text = script.read_bytes().decode()  # as bash reads it: no newline translation
        # One value never spreads over lines: every character is printable but the lines' own breaks.
        assert all(c.isprintable() for c in text.replace("\n", "")), (hostile, text)
        head = text.split("\nset -u\n")[0].split("\n")
        assert all(line.startswith("#") or not line for line in head), (hostile, head)
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0, hostile
        found = _options(text)
        assert found["--output"].replace("%%", "%") == f"{run_dir}/slurm-%j.out", (hostile, found)
        assert found["--job-name"] == f"lorakit-{run_dir.name}", hostile
        if field.startswith("--") and field not in ("--gpu-memory", "--mem"):
            assert found[field] == hostile, (hostile, found)
        # Run it as Slurm would (stand-ins for srun and scontrol): no value runs as code, and the nodes get
        # the recipe and every override exactly as given.
        record = case / "srun-args"
        _standins(case / "bin", record)
        env = {**os.environ, "PATH": f"{case / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_ID": "77",
               "SLURM_JOB_NODELIST": "node1"}  # fmt: skip
        env.pop("LORAKIT_PYTHON", None)
        done = subprocess.run(["bash", str(script)], cwd=case, env=env, capture_output=True, text=True)
        assert done.returncode == 0, (hostile, done.stderr)
        assert not list(tmp_path.rglob("PWNED")), hostile
        preflight, train = [call.split("\0")[:-1] for call in record.read_bytes().decode().split("\1")[:-1]]
        given = train[train.index("--") + 1 :]
        assert given == [str(Path(recipe).resolve()), *overrides[:-1], "distributed.num_processes=8",
                         f"output.dir={run_dir}"], (hostile, given)  # fmt: skip
        if field == "python":
            assert f"/opt/py{hostile}/python" in train and f"/opt/py{hostile}/python" in preflight, hostile
        if field == "workdir":
            assert done.stdout.count("lorakit: job 77") == 1


def test_a_job_spec_with_a_line_break_in_a_value_renders_one_line_per_value():
    job = JobSpec(recipe="/r/a\nb.yaml", overrides=["data.prompt_template=Q:\n{input}\nA:"], run_dir="/o",
                  workdir="/w", python="/py", nodes=2, gpus_per_node=1, name="j", command="x\ny")  # fmt: skip
    text = render(job)
    assert "RECIPE=$'/r/a\\x0ab.yaml'" in text and "  $'data.prompt_template=Q:\\x0a{input}\\x0aA:'" in text
    assert "# written by: x\\ny" in text
