"""Publishing to the Hugging Face Hub (docs/publish.md), with huggingface_hub's own client against a local
fake of the Hub's HTTP API (tests/fake_hub.py) that records every request and commit.

One small MNLI run (1 process, 2 steps, merged) pushes itself at the end through output.push_to_hub; the
other tests push that run again with `python -m lorakit.push`, and make each failure happen once."""

from __future__ import annotations

import importlib
import json
import os
import re
import socket
from pathlib import Path

import pytest

from lorakit import rundir
from lorakit.export.public import public_recipe
from tests.conftest import RECIPES
from tests.e2e.test_quickstart import run_recipe
from tests.fake_hub import TOKEN, USER, FakeHubServer, client_env

REPO = f"{USER}/mnli-tiny"
OVERRIDES = (
    "distributed.num_processes=1",
    "train.max_steps=2",
    "data.max_samples=64",
    "data.max_eval_samples=12",
    "output.merge=true",
    f"output.push_to_hub.repo_id={REPO}",
    "output.push_to_hub.private=true",
)
MERGED = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}
ADAPTER = {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json"}
RUN_FILES = {"README.md", "recipe.yaml", "loss.png", "confusion_matrix.png"}


@pytest.fixture(scope="module")
def hub():
    with FakeHubServer() as server:
        yield server


@pytest.fixture(scope="module")
def pushed(hub, tmp_path_factory):
    """(the run directory, the training command's result): trained, merged and pushed by
    `python -m lorakit.run`, with HF_ENDPOINT pointing at the fake Hub."""
    base = tmp_path_factory.mktemp("push")
    env = client_env(os.environ, hub.url, base / "hf-home")
    proc, _, run_dir = run_recipe(base, "quickstart_mnli.yaml", *OVERRIDES, env=env)
    return run_dir, proc


def _snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file under `directory` with its size and modification time, to show a push changed nothing."""
    return {
        str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.rglob("*")
    }


def test_a_run_pushes_its_merged_model_and_adapter_in_one_commit(hub, pushed):
    run_dir, proc = pushed
    [commit] = [c for c in hub.hub.commits if c.repo_id == REPO]
    assert set(commit.files) == MERGED | {f"adapter/{n}" for n in ADAPTER} | RUN_FILES
    assert (commit.revision, commit.create_pr) == ("main", False)
    # The shards go through the LFS batch API (uploaded before the commit, which holds their pointers).
    assert set(commit.lfs) == {"model.safetensors", "adapter/adapter_model.safetensors"}
    for name in MERGED:
        assert commit.files[name] == (run_dir / "merged" / name).read_bytes(), name
    for name in ADAPTER - {"adapter_config.json"}:
        assert commit.files[f"adapter/{name}"] == (run_dir / "adapter" / name).read_bytes(), name
    for name in ("loss.png", "confusion_matrix.png"):
        assert commit.files[name] == (run_dir / name).read_bytes(), name
    # No absolute path of this machine leaves it: the recipe's and peft's base path are shortened.
    assert commit.files["recipe.yaml"] == public_recipe((run_dir / "recipe.yaml").read_text())[0].encode()
    config = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    pushed_config = json.loads(commit.files["adapter/adapter_config.json"])
    assert pushed_config == {
        **config,
        "base_model_name_or_path": Path(config["base_model_name_or_path"]).name,
    }
    for name in ("recipe.yaml", "README.md", "adapter/adapter_config.json"):
        assert str(run_dir.parent) not in commit.files[name].decode(), name
    # Every file and its size was listed before the upload.
    listing = proc.stdout[proc.stdout.index(f"uploading to {REPO}: {len(commit.files)} files, ") :]
    assert listing.index("  adapter/adapter_model.safetensors  ") < listing.index("pushed:   ")
    # The repository was created private, after the token was checked; the commit came last.
    [create] = hub.hub.calls("POST", "/api/repos/create")
    assert create[3] == {"name": "mnli-tiny", "organization": USER, "visibility": "private"}
    order = [r[1] for r in hub.hub.requests if REPO in r[1] or r[1] == "/api/whoami-v2"]
    assert order[0] == "/api/whoami-v2" and order[-1] == f"/api/models/{REPO}/commit/main"
    assert f"pushed:   {hub.url}/{REPO}/commit/" in proc.stdout
    summary = rundir.read_summary(run_dir)
    assert summary["merged_dir"] and summary["classification"]


def test_the_card_tells_what_the_run_did(hub, pushed):
    run_dir, _ = pushed
    [commit] = [c for c in hub.hub.commits if c.repo_id == REPO]
    card = commit.files["README.md"].decode()
    s = rundir.read_summary(run_dir)
    assert card.startswith("---\nlibrary_name: transformers\n")
    assert "- method: lora: r=16, alpha=32, dropout=0.05, target_modules=all-linear" in card
    assert "- data: `builtin:mnli_sample`, format instruction: 64 training rows, 12 evaluation rows" in card
    assert '- labels: ["entailment", "neutral", "contradiction"]' in card
    assert "- trained: 2 optimizer steps (1 epoch, stopped by max_steps)" in card
    assert "- hardware: 1 process on cpu, ZeRO-3, bfloat16" in card and " s of training, " in card
    assert (
        "![training loss per step](loss.png)" in card and "![confusion matrix](confusion_matrix.png)" in card
    )
    assert f"| accuracy | {s['eval']['accuracy']:.4f} |" in card
    for label, row in zip(
        s["classification"]["labels"], s["classification"]["confusion_matrix"], strict=True
    ):
        assert f"| {label} | " + " | ".join(map(str, row)) + " |" in card
    assert "## Verification" in card and "merged vs the adapter model" in card and "max |logit diff|" in card
    assert public_recipe((run_dir / "recipe.yaml").read_text())[0].rstrip() in card
    assert f"- lorakit: {s['versions']['lorakit']}" in card
    if s["git_revision"]:
        assert f"- git revision of the training code: {s['git_revision']}" in card


def test_the_card_snippets_load_the_pushed_files(hub, pushed, tmp_path, capsys):
    """Each python block of the card's Usage section runs against the commit's files written to a directory
    (the repository id replaced by its path), and loads the model it names."""
    [commit] = [c for c in hub.hub.commits if c.repo_id == REPO]
    repo = tmp_path / "repo"
    for name, data in commit.files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_bytes(data)
    usage = commit.files["README.md"].decode().split("## Usage", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", usage, re.DOTALL)
    assert len(blocks) == 2  # the merged model (transformers), the adapter (PEFT)
    kinds = []
    # The card names the local base by its last part ("load it from where it is on your machine").
    base = json.loads((pushed[0] / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    for block in blocks:
        scope: dict = {}
        block = block.replace(f'"{REPO}"', repr(str(repo))).replace(f'"{Path(base).name}"', repr(base))
        exec(compile(block, "card", "exec"), scope)
        kinds.append(type(scope["model"]).__name__)
    assert kinds == ["T5ForConditionalGeneration", "PeftModelForSeq2SeqLM"]
    assert len(capsys.readouterr().out.splitlines()) >= 2  # each printed its generation


def test_push_cli_an_adapter_to_a_new_branch_as_a_pull_request(client, hub, pushed, capsys):
    from lorakit.push import main

    client()
    run_dir, _ = pushed
    before = _snapshot(run_dir)
    repo = f"{USER}/adapter-only"
    code = main([str(run_dir / "adapter"), repo, "--revision", "dev", "--create-pr", "--private"])
    out, err = capsys.readouterr()
    assert code == 0, err
    [commit] = [c for c in hub.hub.commits if c.repo_id == repo]
    assert set(commit.files) == ADAPTER | RUN_FILES
    assert (commit.revision, commit.create_pr) == ("dev", True)
    assert hub.hub.calls("POST", f"/api/models/{repo}/branch/dev")
    [create] = hub.hub.calls("POST", "/api/repos/create")[-1:]
    assert create[3] == {"name": "adapter-only", "organization": USER, "visibility": "private"}
    assert f"{hub.url}/{repo}/discussions/1" in out
    assert commit.files["README.md"].decode().startswith("---\nlibrary_name: peft\n")
    assert _snapshot(run_dir) == before


@pytest.fixture
def client(hub, tmp_path):
    """huggingface_hub in this process configured as a fresh process would be with HF_ENDPOINT (the fake Hub),
    HF_TOKEN and its own HF_HOME: `client(**env)` sets more variables (None unsets one). Its constants are
    read at import, so they are read again, and once more when the test is over."""
    from huggingface_hub import constants

    saved = dict(os.environ)

    def configure(**extra):
        env = client_env(os.environ, hub.url, tmp_path / "hf-home")
        for key, value in extra.items():
            env.pop(key, None) if value is None else env.__setitem__(key, value)
        os.environ.clear()
        os.environ.update(env)
        importlib.reload(constants)

    configure()
    yield configure
    os.environ.clear()
    os.environ.update(saved)
    importlib.reload(constants)


def _push(run_dir: Path, repo: str, capsys) -> tuple[int, str]:
    from lorakit.push import main

    code = main([str(run_dir), repo])
    return code, capsys.readouterr().err


FAILURES = {
    "no token": (
        {"HF_TOKEN": None},
        r"^error: no Hugging Face token: set HF_TOKEN to a token with write access",
    ),
    "offline": (
        {"HF_HUB_OFFLINE": "1"},
        r"^error: HF_HUB_OFFLINE is set: the push to the Hugging Face Hub is refused",
    ),
    "a refused token": ({"HF_TOKEN": "hf_wrong"}, r"^error: the Hub refused the token \(401 Unauthorized\)"),
}


@pytest.mark.parametrize("case", FAILURES)
def test_push_refused_before_any_upload(client, hub, pushed, capsys, case):
    env, message = FAILURES[case]
    client(**env)
    run_dir, _ = pushed
    before, requests = _snapshot(run_dir), len(hub.hub.requests)
    code, err = _push(run_dir, f"{USER}/refused", capsys)
    assert code == 69 and re.search(message, err), err
    assert err.rstrip().endswith("see docs/publish.md#when-a-push-fails") and len(err.splitlines()) == 2
    sent = [r[1] for r in hub.hub.requests[requests:] if r[1] != "/api/agent-harnesses"]
    assert sent == (["/api/whoami-v2"] if case == "a refused token" else [])
    assert _snapshot(run_dir) == before and f"{USER}/refused" not in hub.hub.repos


def test_push_to_an_unreachable_hub(client, pushed, capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client(HF_ENDPOINT=f"http://127.0.0.1:{port}")
    run_dir, _ = pushed
    before = _snapshot(run_dir)
    code, err = _push(run_dir, f"{USER}/unreachable", capsys)
    assert code == 69, err
    assert f"error: cannot reach the Hugging Face Hub at http://127.0.0.1:{port} (" in err
    assert "check the network (and HF_ENDPOINT), then run the same push again" in err
    assert _snapshot(run_dir) == before


def test_push_to_someone_elses_repository(client, hub, pushed, capsys):
    client()
    run_dir, _ = pushed
    uploads = len(hub.hub.lfs_uploads)
    code, err = _push(run_dir, "someone/taken", capsys)
    assert code == 69
    assert err.startswith(
        "error: someone/taken: the Hub refused the push (403 Forbidden): the repository belongs to another user"
    )
    assert f"push to a repository of your own (e.g. {USER}/taken)" in err
    # Refused at the preupload request: nothing was uploaded or committed.
    assert not [c for c in hub.hub.commits if c.repo_id == "someone/taken"]
    assert len(hub.hub.lfs_uploads) == uploads


def test_an_interrupted_push_is_run_again_without_sending_the_shards_twice(client, hub, pushed, capsys):
    client()
    run_dir, _ = pushed
    repo = f"{USER}/interrupted"
    before = _snapshot(run_dir)
    hub.hub.drop_next_commit = True
    uploads = len(hub.hub.lfs_uploads)
    code, err = _push(run_dir, repo, capsys)
    assert code == 69 and f"error: the push to {repo} was interrupted (" in err
    assert "no commit was made and the local files are untouched; run the same push again" in err
    assert not [c for c in hub.hub.commits if c.repo_id == repo] and _snapshot(run_dir) == before
    # Run again: the Hub holds the shards already (the first push of this run sent them), so the LFS batch
    # API asks for none, and the commit is made.
    code, err = _push(run_dir, repo, capsys)
    assert code == 0, err
    assert len(hub.hub.lfs_uploads) == uploads
    [commit] = [c for c in hub.hub.commits if c.repo_id == repo]
    assert set(commit.files) == MERGED | {f"adapter/{n}" for n in ADAPTER} | RUN_FILES


def test_bad_input_is_exit_code_2(client, tmp_path, capsys):
    from lorakit.push import main

    assert main([str(tmp_path / "nowhere"), f"{USER}/x"]) == 2
    assert "no such directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), "not-a-repo-id"]) == 2
    assert "a repository id is OWNER/NAME" in capsys.readouterr().err


def test_training_refuses_to_start_when_it_could_not_push(client, tmp_path, capsys):
    """output.push_to_hub with HF_HUB_OFFLINE set (or no token): refused before any work, exit 69."""
    from lorakit.run import main

    client(HF_HUB_OFFLINE="1")
    out = tmp_path / "run"
    args = [str(RECIPES / "quickstart.yaml"), f"output.dir={out}", f"output.push_to_hub.repo_id={USER}/x"]
    assert main(args) == 69
    assert "HF_HUB_OFFLINE is set" in capsys.readouterr().err and not out.exists()


def test_a_workers_push_failure_is_the_launchers_exit_code(tmp_path):
    """Under torchrun the push runs in rank 0's worker: its PublishError reaches the launching process."""
    from lorakit.api import _raise_worker_exit
    from lorakit.errors import PublishError

    rundir.write_json(tmp_path / "exit.json", {"code": 69, "error": "PublishError", "message": "no token"})
    with pytest.raises(PublishError, match="no token") as e:
        _raise_worker_exit(tmp_path, {})
    assert e.value.exit_code == 69


def test_the_token_is_never_printed(hub, pushed):
    _, proc = pushed
    assert TOKEN not in proc.stdout + proc.stderr
