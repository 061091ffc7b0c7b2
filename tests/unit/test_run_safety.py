"""Nothing lost, no one let in (issue 44): a run writes only into a directory that is new, empty or
lorakit's own; every artifact is written durably (its files and its directory fsynced); crash leftovers are
recovered; checkpoints are checked against their manifest before anything is loaded, damaged ones are set
aside and resume falls back; a rollback moves the abandoned branch aside; trust_remote_code and
allow_pickle come only from the person running the command."""

from __future__ import annotations

import json
import os
from pathlib import Path

import datasets
import pytest
import torch
import yaml

from lorakit import rundir, storage
from lorakit.data.cache import save_cached
from lorakit.engine import branches, compatibility, manifest
from lorakit.engine import checkpoint as ck
from lorakit.errors import MergeError, RecipeError, RunDirError, RunLockedError
from lorakit.evaluation.classify import classification_report, plot_confusion_matrix
from lorakit.export.output import atomic_directory
from lorakit.export.sources import locate
from lorakit.model.families.tiny import resolve_model_source
from lorakit.observe.metrics import JsonlSink
from lorakit.observe.plot import plot_losses
from lorakit.recipe import reference
from lorakit.recipe.read_back import NotGranted
from lorakit.report import plots
from lorakit.report.plots import draw_all
from lorakit.report.runs import RunRow
from lorakit.runlock import RunLock
from tests.conftest import tiny_recipe, tiny_recipe_dict

# --- the run directory --------------------------------------------------------------------------------


def test_a_run_writes_only_into_a_new_empty_or_lorakit_directory(tmp_path):
    assert rundir.check_trusted(tmp_path / "new") == "new"
    (tmp_path / "empty").mkdir()
    assert rundir.check_trusted(tmp_path / "empty") == "empty"
    with RunLock(tmp_path / "locked"):  # held by another run: the lock refuses it, naming the holder
        assert rundir.check_trusted(tmp_path / "locked") == "empty"
    # A project folder (a model/ package, W&B's ./wandb): refused, naming the directory, before the lock is
    # taken or anything is written.
    project = tmp_path / "project"
    (project / "model").mkdir(parents=True)
    (project / "wandb").mkdir()
    with pytest.raises(RunDirError, match=f"output.dir {project} is not empty and is not a lorakit run") as e:
        RunLock(project, claim=True).acquire()
    assert e.value.exit_code == 2 and "model, wandb" in str(e.value)
    assert sorted(p.name for p in project.iterdir()) == ["model", "wandb"]
    # A run directory of a lorakit from before the marker: recipe.yaml and summary.json (or exit.json,
    # metrics.jsonl, checkpoints/); adopted with a line, and marked.
    older = tmp_path / "older"
    older.mkdir()
    (older / rundir.RECIPE).write_text("model: {}\n")
    rundir.write_json(older / rundir.SUMMARY, {"steps": 3, "versions": {"python": "3.11", "lorakit": "0.1"}})
    lines = []
    with RunLock(older, claim=True, say=lines.append):
        assert (older / rundir.MARKER).is_file()
    assert rundir.check_trusted(older) == "marked" and "earlier lorakit" in lines[0]
    # recipe.yaml alone is not a run directory.
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / rundir.RECIPE).write_text("x: 1\n")
    with pytest.raises(RunDirError):
        rundir.check_trusted(tmp_path / "notes")


@pytest.mark.parametrize(
    "names",
    [
        {rundir.EXIT: "{}"},  # what the adoption heuristic took as proof before
        {rundir.METRICS: '{"loss": 1}\n'},
        {rundir.SUMMARY: '{"accuracy": 0.9}'},  # a summary.json of another tool
        {"checkpoints/step-1/state.json": '{"step": 1}'},
        {rundir.SUMMARY: '{"versions": {"lorakit": "0.1"}}', rundir.MARKER: "x"},  # a marker not lorakit's
    ],
    ids=["exit", "metrics", "foreign-summary", "foreign-checkpoint", "foreign-marker"],
)
def test_a_folder_is_adopted_only_on_proof_that_lorakit_wrote_it(tmp_path, names):
    """A project folder with a recipe.yaml and files of the names lorakit uses is no run directory: a run
    refuses it (exit 2) and writes and deletes nothing in it."""
    project = tmp_path / "project"
    (project / "model").mkdir(parents=True)
    (project / "model" / "mine.py").write_text("x = 1\n")
    (project / rundir.RECIPE).write_text("model: {name_or_path: tiny:t5}\n")
    for name, text in names.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text)
    if rundir.MARKER in names:
        (project / rundir.SUMMARY).write_text('{"accuracy": 0.9}')
    before = sorted(str(p.relative_to(project)) for p in project.rglob("*"))
    with pytest.raises(RunDirError, match="is not a lorakit run directory") as e:
        RunLock(project, claim=True).acquire()
    assert e.value.exit_code == 2
    assert sorted(str(p.relative_to(project)) for p in project.rglob("*")) == before


def test_a_run_directory_of_an_earlier_lorakit_is_known_by_its_checkpoint(tmp_path):
    older = tmp_path / "older"
    (older / "checkpoints" / "step-4").mkdir(parents=True)
    (older / rundir.RECIPE).write_text("model: {}\n")
    state = {"step": 4, "recipe": {"model": {}}, "loop": {"epoch": 0}}
    (older / "checkpoints" / "step-4" / "state.json").write_text(json.dumps(state))
    assert rundir.check_trusted(older) == "older"


@pytest.mark.parametrize("name", [rundir.MODEL, rundir.ADAPTER, rundir.MERGED, rundir.BEST, rundir.SUMMARY,
                                  rundir.RECIPE, rundir.CHECKPOINTS, rundir.TENSORBOARD])  # fmt: skip
def test_a_link_where_a_run_writes_is_refused_before_anything_is_written(tmp_path, name):
    """A link in a run directory (model/ -> a folder elsewhere) is refused up front, naming it: never
    followed for deletion or replacement, and never found at the end of a whole training run."""
    run = tmp_path / "run"
    with RunLock(run, claim=True):
        (run / "notes.txt").write_text("a run wrote something")
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    (run / name).symlink_to(target, target_is_directory=True)
    with pytest.raises(RunDirError, match=rf"{run / name} is a symbolic link") as e:
        RunLock(run, claim=True).acquire()
    assert e.value.exit_code == 2
    assert (target / "keep.txt").read_text() == "mine" and (run / name).is_symlink()


def test_earlier_outputs_are_moved_aside_never_deleted(tmp_path):
    from lorakit.engine.job import retire_earlier_outputs
    from tests.conftest import tiny_recipe

    run = tmp_path / "run"
    with RunLock(run, claim=True):
        for name in (rundir.MODEL, rundir.MERGED):
            (run / name).mkdir()
            (run / name / "weights.safetensors").write_text(name)
        recipe = tiny_recipe(tmp_path / "cache", run)  # a LoRA run: no model/, no merge
        assert sorted(retire_earlier_outputs(recipe, run, None)) == [rundir.MERGED, rundir.MODEL]
    assert not (run / rundir.MODEL).exists() and not (run / rundir.MERGED).exists()
    moved = branches.moved_aside(run)
    assert len(moved) == 1 and sorted(moved[0]["moved"]) == [rundir.MERGED, rundir.MODEL]
    kept = Path(moved[0]["folder"])
    assert (kept / rundir.MODEL / "weights.safetensors").read_text() == rundir.MODEL


def test_a_claimed_directory_that_got_nothing_is_removed_again(tmp_path):
    with RunLock(tmp_path / "runs" / "x", claim=True):
        assert (tmp_path / "runs" / "x" / rundir.MARKER).is_file()
    assert not (tmp_path / "runs").exists()
    with RunLock(tmp_path / "kept", claim=True):
        rundir.write_json(tmp_path / "kept" / rundir.SUMMARY, {})
    assert rundir.check_trusted(tmp_path / "kept") == "marked"


def test_a_crash_between_the_two_renames_of_a_replacement_is_undone_by_the_next_run(tmp_path):
    run = tmp_path / "run"
    (run / ".adapter.old-1a2b3c4d").mkdir(parents=True)  # the old adapter, moved aside; no new one yet
    (run / ".adapter.old-1a2b3c4d" / "adapter_model.safetensors").write_bytes(b"old weights")
    (run / ".adapter.tmp-99-deadbeef").mkdir()  # the new one, half written
    (run / "merged").mkdir()
    (run / ".merged.old-00000000").mkdir()  # a finished replacement's old copy, not yet deleted
    rundir.mark(run)
    lines = []
    with RunLock(run, claim=True, say=lines.append):
        pass
    assert (run / "adapter" / "adapter_model.safetensors").read_bytes() == b"old weights"
    assert (
        sorted(p.name for p in run.iterdir() if p.name.startswith(".adapter") or p.name.startswith(".merged"))
        == []
    )
    assert any("restored adapter/" in line for line in lines)


def test_replacing_a_directory_swaps_whole_directories(tmp_path):
    final = tmp_path / "adapter"
    with storage.new_directory(final) as tmp:
        (tmp / "a").write_text("1")
    with storage.new_directory(final) as tmp:
        (tmp / "b").write_text("2")
    assert [p.name for p in final.iterdir()] == ["b"]
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]
    # A failed write leaves the old directory as it was.
    with pytest.raises(RuntimeError), storage.new_directory(final) as tmp:
        (tmp / "c").write_text("3")
        raise RuntimeError("failed")
    assert [p.name for p in final.iterdir()] == ["b"] and [p.name for p in tmp_path.iterdir()] == ["adapter"]
    # --force over a file: swapped too, the file gone afterwards.
    (tmp_path / "export").write_text("a file")
    with atomic_directory(tmp_path / "export", force=True) as tmp:
        (tmp / "config.json").write_text("{}")
    assert [p.name for p in (tmp_path / "export").iterdir()] == ["config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "export"]


# --- durability ----------------------------------------------------------------------------------------


@pytest.fixture
def fsyncs(monkeypatch):
    """Every path fsynced (a file or a directory), in order, as /proc/self/fd names it."""
    seen: list[str] = []
    real = os.fsync

    def spy(fd):
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return seen


def _synced_before_published(seen: list[str], parent: Path, name: str, file: str | None = None) -> None:
    """A file of `name` (written under a temp name beside it) and, after it, `parent` were fsynced."""
    temp = [i for i, p in enumerate(seen) if Path(p).parent == parent and Path(p).name.startswith(f".{name}")]
    assert temp, (name, seen)
    if file is not None:
        assert any(Path(p).name == file and Path(p).parent.name.startswith(f".{name}") for p in seen), seen
    assert any(p == str(parent) for p in seen[temp[-1] :]), (name, seen)


def test_every_artifact_is_fsynced_file_and_parent(tmp_path, fsyncs):
    run = tmp_path / "run"
    run.mkdir()
    # summary.json and every JSON file of the run directory
    rundir.write_json(run / rundir.SUMMARY, {"ok": True})
    _synced_before_published(fsyncs, run, rundir.SUMMARY)
    # adapter/, model/, best/: storage.new_directory (engine/save.py writes each through it), also replacing
    for name in (rundir.ADAPTER, rundir.MODEL, rundir.BEST, rundir.ADAPTER):
        fsyncs.clear()
        with storage.new_directory(run / name) as tmp:
            (tmp / "adapter_model.safetensors").write_bytes(b"w")
        _synced_before_published(fsyncs, run, name, "adapter_model.safetensors")
    # the merged export (export/output.py), README.md (its model card) included
    fsyncs.clear()
    with atomic_directory(run / rundir.MERGED, force=False) as tmp:
        (tmp / "README.md").write_text("card")
    _synced_before_published(fsyncs, run, rundir.MERGED, "README.md")
    fsyncs.clear()
    with atomic_directory(run / rundir.MERGED, force=True) as tmp:
        (tmp / "model.safetensors").write_bytes(b"w")
    _synced_before_published(fsyncs, run, rundir.MERGED, "model.safetensors")
    # metrics.jsonl: appended line by line, fsynced (with its directory) when the run closes it
    fsyncs.clear()
    sink = JsonlSink(run / rundir.METRICS)
    sink.write({"step": 1})
    sink.close()
    assert fsyncs == [str(run / rundir.METRICS), str(run)]
    # the token cache (data/cache.py)
    fsyncs.clear()
    entry = tmp_path / "cache" / "datasets" / "key"
    save_cached(entry, {"train": datasets.Dataset.from_dict({"x": [1, 2]})}, {"rows": 2})
    assert (entry / "meta.json").is_file()
    assert any(Path(p).name == "meta.json" for p in fsyncs)
    assert fsyncs[-1] == str(entry.parent)
    # loss.png and confusion_matrix.png (rendered to bytes, then storage.write_file), a comparison's plots
    record = {"kind": "train", "step": 1, "loss": 2.0}
    (run / rundir.METRICS).write_text(json.dumps(record) + "\n")
    compared = tmp_path / "compared"
    compared.mkdir()
    for draw, name, where in (
        (lambda: plot_losses(run), rundir.LOSS_PLOT, run),
        (lambda: plot_confusion_matrix(classification_report("a", "a", "a"), run / "cm.png"), "cm.png", run),
        (lambda: draw_all([RunRow(run, "r", train_records=[record])], compared), plots.LOSS, compared),
    ):
        fsyncs.clear()
        draw()
        _synced_before_published(fsyncs, where, name)
    # writers outside a run: the generated recipe reference (docs/recipes.md), a tiny model's directory
    fsyncs.clear()
    reference.write(tmp_path / "recipes.md", "# page\n")
    _synced_before_published(fsyncs, tmp_path, "recipes.md")
    fsyncs.clear()
    built = Path(resolve_model_source("tiny:llama", tmp_path / "tiny"))
    _synced_before_published(fsyncs, built.parent, built.name, "config.json")


# --- checkpoints: manifest, damage, fallback, rollback --------------------------------------------------


def _recipe(tmp_path, **sections):
    return tiny_recipe(tmp_path / "cache", tmp_path / "run", **sections)


def _checkpoint(run_dir: Path, step: int, recipe, best: dict | None = None) -> Path:
    """A checkpoint as _publish writes it: engine files, state.json naming its manifest, manifest.json."""
    d = run_dir / "checkpoints" / f"step-{step:08d}"
    (d / ck.ENGINE).mkdir(parents=True)
    torch.save({"w": torch.full((64,), float(step))}, d / ck.ENGINE / "mp_rank_00_model_states.pt")
    state = {
        "format": compatibility.FORMAT_VERSION,
        "manifest": manifest.MANIFEST,
        "reason": "every",
        "world_size": 1,
        "fingerprint": compatibility.recipe_fingerprint(recipe),
        "recipe": recipe.model_dump(mode="json"),
        "loop": {"step": step, "best": best},
    }
    rundir.write_json(d / ck.STATE, state)
    manifest.write_manifest(d, rundir.write_json)
    return d


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one_with_a_warning(tmp_path, capsys):
    recipe = _recipe(tmp_path)
    run = tmp_path / "run"
    for step in (2, 4, 6):
        _checkpoint(run, step, recipe)
    weights = run / "checkpoints" / "step-00000006" / ck.ENGINE / "mp_rank_00_model_states.pt"
    weights.write_bytes(weights.read_bytes()[:100])  # a half-copied file: never handed to torch.load
    (run / "checkpoints" / "step-00000004" / ck.ENGINE / "extra.pt").write_bytes(b"planted")
    assert ck.find_resume(recipe, run).step == 2
    out = capsys.readouterr().out
    assert f"warning: checkpoint {run / 'checkpoints' / 'step-00000006'} is damaged" in out
    assert "has 100 bytes" in out and "engine/extra.pt is not in its manifest.json" in out
    # Set aside (recorded), so pruning and the next auto see only the sound one.
    assert [c.step for c in ck.complete_checkpoints(run)] == [2]
    assert {r["why"] for r in branches.moved_aside(run)} == {
        "damaged checkpoint step-00000006",
        "damaged checkpoint step-00000004",
    }
    # A changed byte (same size) is found by its hash; with none left, exit 2 naming what was wrong.
    only = run / "checkpoints" / "step-00000002" / ck.ENGINE / "mp_rank_00_model_states.pt"
    data = bytearray(only.read_bytes())
    data[-1] ^= 1
    only.write_bytes(bytes(data))
    with pytest.raises(RecipeError, match="every checkpoint in .* is damaged .*SHA-256 differs") as e:
        ck.find_resume(recipe, run)
    assert e.value.exit_code == 2


def test_a_damaged_checkpoint_named_by_path_is_refused(tmp_path):
    recipe = _recipe(tmp_path)
    d = _checkpoint(tmp_path / "run", 2, recipe)
    (d / manifest.MANIFEST).unlink()
    named = _recipe(tmp_path, train={"resume": str(d)})
    with pytest.raises(RecipeError, match="is damaged: its manifest.json is missing; nothing was loaded"):
        ck.find_resume(named, tmp_path / "run")


def test_a_rollback_moves_the_abandoned_branch_and_its_best_aside(tmp_path):
    recipe = _recipe(tmp_path)
    run = tmp_path / "run"
    for step in (2, 4, 6):
        _checkpoint(run, step, recipe)
    with storage.new_directory(run / rundir.BEST) as tmp:
        rundir.write_json(tmp / rundir.BEST_INFO, {"step": 5, "value": 0.1})
    back = _recipe(tmp_path, train={"resume": str(run / "checkpoints" / "step-00000002")})
    assert ck.find_resume(back, run).step == 2
    [record] = branches.moved_aside(run)
    assert record["why"] == "rolled back to step 2"
    assert record["moved"] == ["checkpoints/step-00000004", "checkpoints/step-00000006", "best"]
    assert (Path(record["folder"]) / "best" / rundir.BEST_INFO).is_file() and not (run / rundir.BEST).exists()
    # A later preemption's `resume: auto` continues the chosen branch, not the abandoned one.
    assert ck.find_resume(recipe, run).step == 2


def test_hashing_streams_the_file(tmp_path):
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(3 << 20) * 4)  # 12 MiB: more than one 8 MiB chunk
    import hashlib

    assert manifest.file_digest(big) == hashlib.sha256(big.read_bytes()).hexdigest()


# --- trust from the person running the command ----------------------------------------------------------


def test_trust_remote_code_and_allow_pickle_come_from_the_caller_not_the_run_directory(tmp_path):
    # A run directory (or a downloaded Hub snapshot with the "both" layout) whose recipe asks for both.
    run = tmp_path / "snapshot"
    raw = tiny_recipe_dict(tmp_path / "cache", run, method={"kind": "full"})
    raw["model"] |= {"trust_remote_code": True, "allow_pickle": True}
    (run / rundir.MODEL).mkdir(parents=True)
    (run / rundir.MODEL / "config.json").write_text("{}")
    (run / rundir.RECIPE).write_text(yaml.safe_dump(raw))
    # Asked for by the directory, not granted by the caller: refused, naming the field and the flag.
    with pytest.raises(NotGranted, match="model.trust_remote_code is true.*pass --trust-remote-code"):
        locate(run)
    with pytest.raises(NotGranted, match="model.allow_pickle is true.*pass --allow-pickle"):
        locate(run, trust_remote_code=True)
    mine = locate(run, trust_remote_code=True, allow_pickle=True)
    assert mine.trust_remote_code and mine.allow_pickle and mine.recipe.model.trust_remote_code


def test_merge_and_inference_load_safetensors_only_unless_the_caller_allows_pickles(tmp_path):
    from transformers import AutoModelForCausalLM

    from lorakit.export.loading import load_pretrained
    from lorakit.model.families.tiny import build_tiny_model

    model = build_tiny_model("llama", tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "m" / "pytorch_model.bin")
    raw = tiny_recipe_dict(tmp_path / "cache", tmp_path / "run", method={"kind": "full"})
    run = tmp_path / "run"
    (run / rundir.MODEL).mkdir(parents=True)
    for f in (tmp_path / "m").iterdir():
        (run / rundir.MODEL / f.name).write_bytes(f.read_bytes())
    (run / rundir.RECIPE).write_text(yaml.safe_dump(raw))
    with pytest.raises(MergeError, match="no safetensors weights found .* Pass --allow-pickle"):
        load_pretrained(AutoModelForCausalLM, str(run / rundir.MODEL), torch.float32, locate(run))
    allowed = locate(run, allow_pickle=True)
    loaded = load_pretrained(AutoModelForCausalLM, str(run / rundir.MODEL), torch.float32, allowed)
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in model.parameters())


def test_a_missing_shard_is_not_taken_for_missing_safetensors(tmp_path):
    from transformers import AutoModelForCausalLM

    from lorakit.model.build import no_safetensors_weights
    from lorakit.model.families.tiny import build_tiny_model

    model = build_tiny_model("llama", tmp_path / "m")
    model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="20KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    (tmp_path / "sharded" / sorted(set(index["weight_map"].values()))[1]).unlink()
    with pytest.raises(OSError) as lost:
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "sharded"), use_safetensors=True)
    assert not no_safetensors_weights(lost.value)
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(OSError) as none:
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), use_safetensors=True)
    assert no_safetensors_weights(none.value)


def test_push_of_a_run_directory_takes_its_run_lock(tmp_path):
    from lorakit.export.publish import push

    run = tmp_path / "run"
    run.mkdir()
    (run / rundir.RECIPE).write_text("model: {}\n")
    with RunLock(run, command="python -m lorakit.run x.yaml"):
        # Refused before anything is read or sent: a relaunch could be replacing adapter/ meanwhile.
        with pytest.raises(
            RunLockedError, match=r"in use by another run: .*\(python -m lorakit.run x.yaml\)"
        ):
            push(run, "me/model")


def test_the_recipe_file_given_is_never_written_to(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    given = run / rundir.RECIPE
    given.write_text("resolved: 1\n")
    inode = given.stat().st_ino
    # The same resolved recipe (a relaunch by the run's own recipe.yaml): allowed, and the file not rewritten.
    rundir.check_recipe_file(given, run, "resolved: 1\n")
    rundir.write_recipe(run, "resolved: 1\n")
    assert given.stat().st_ino == inode
    # Another resolved recipe (an override): the run would write over the file it was given.
    with pytest.raises(RunDirError, match="is the run's recipe.yaml in output.dir") as e:
        rundir.check_recipe_file(given, run, "resolved: 2\n")
    assert e.value.exit_code == 2 and given.read_text() == "resolved: 1\n"
    # A recipe file elsewhere is the user's; the run directory's copy is lorakit's to replace.
    mine = tmp_path / "mine.yaml"
    mine.write_text("resolved: 2\n")
    rundir.check_recipe_file(mine, run, "resolved: 2\n")
    rundir.write_recipe(run, "resolved: 2\n")
    assert given.read_text() == "resolved: 2\n" and mine.read_text() == "resolved: 2\n"
