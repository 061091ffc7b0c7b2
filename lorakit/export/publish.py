"""Publish a run's adapter (or model) and its merged export to the Hugging Face Hub: one commit holding the
model files, a model card (card.hub_card), recipe.yaml and the run's plots. See docs/publish.md.

huggingface_hub (a dependency of transformers) does the talking: the token is its own (HF_TOKEN, or
`hf auth login`), create_repo / create_branch / create_commit are its calls, and large files go through its
LFS or Xet upload, which skips what the Hub already holds, so running a failed push again sends only what is
missing. Every failure is a PublishError (exit 69) with one line saying what to do; nothing local is written.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from lorakit import rundir
from lorakit.disclosure import redact
from lorakit.errors import LorakitError, PublishError
from lorakit.export.card import ADAPTER_SUBFOLDER, CARD, HubFacts, hub_card, is_hub_id, read_card
from lorakit.export.public import is_local_path, public_path, public_recipe, upload_lines, written_by_lorakit
from lorakit.runlock import holding_run_lock

DOC = "docs/publish.md"
# The run's plots the card shows (written by observe/plot.py and evaluation/classify.py).
IMAGES = (rundir.LOSS_PLOT, rundir.CONFUSION_MATRIX)
_CHECK = re.compile(r"^## Verification\n(.*?)(?=^## |\Z)", re.MULTILINE | re.DOTALL)
_LOGIN = "set HF_TOKEN to a token with write access (https://huggingface.co/settings/tokens) or run `hf auth login`"


@dataclass(frozen=True)
class Bundle:
    """What one push commits: each file's path in the repository and on disk, and the model card."""

    files: dict[str, Path | bytes]  # bytes: made for the push (the public recipe), uploaded from memory
    card: str
    layout: str  # card.LAYOUTS: adapter, merged, or both (merged at the root, the adapter in adapter/)
    left_out: tuple[str, ...] = ()  # files beside the model that lorakit did not write: not pushed
    shortened: tuple[str, ...] = ()  # recipe fields whose absolute local paths became their last part


@dataclass(frozen=True)
class PushResult:
    """What lorakit.push returns: where the commit went and what it held."""

    repo_id: str
    revision: str
    commit_url: str
    pr_url: str | None
    files: tuple[str, ...]  # paths in the repository, README.md included


def check_ready() -> str:
    """Refuse a push that cannot happen, before anything else: offline mode (HF_HUB_OFFLINE) or no token.
    Returns the token."""
    from huggingface_hub import constants as hub
    from huggingface_hub import get_token

    if hub.is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in (
        "1",
        "on",
        "yes",
        "true",
    ):
        raise PublishError(
            "HF_HUB_OFFLINE is set: the push to the Hugging Face Hub is refused; unset it and push with "
            "`python -m lorakit.push RUN_DIR REPO_ID`"
        )
    token = get_token()
    if not token:
        raise PublishError(f"no Hugging Face token: {_LOGIN}")
    return token


def check_before_training(options: Any) -> None:
    """output.push_to_hub (`options`, None when off): what the push would refuse after training (offline
    mode, no token) is refused before it, by the process that will push or launch the workers (rank 0, or
    no launcher: other ranks may not have the token, and need none)."""
    if options is not None and os.environ.get("RANK", "0") == "0":
        check_ready()


def collect(source: str | Path, repo_id: str) -> Bundle:
    """The files and model card of a push of `source`: a run directory (its adapter or model, and its merged
    export when there is one), or one of its adapter/, model/, merged/ directories, or an adapter or merged
    export on its own. LorakitError (exit 2) when `source` is none of these."""
    p = Path(source).expanduser().resolve()
    if not p.is_dir():
        raise LorakitError(
            f"{source}: no such directory (expected a run or export directory)", doc=f"{DOC}#what-is-pushed"
        )
    run_dir = (
        p if (p / rundir.RECIPE).is_file() else p.parent if (p.parent / rundir.RECIPE).is_file() else None
    )
    recipe, recipe_text = _run_recipe(run_dir)
    summary = rundir.read_json_if_exists(run_dir / rundir.SUMMARY) if run_dir is not None else None
    if p == run_dir:
        trained = p / (rundir.ADAPTER if recipe.method.adapter() else rundir.MODEL)
        merged = p / rundir.MERGED
        merged = merged if (merged / "config.json").is_file() else None
        if not _is_model(trained) and merged is None:
            raise LorakitError(
                f"{p}: the run saved no adapter or model (training did not finish, or output.save_adapter was "
                "false); there is nothing to push",
                doc=f"{DOC}#what-is-pushed",
            )
        if recipe.method.adapter() and merged is not None and _is_model(trained):
            parts, layout = {"": merged, ADAPTER_SUBFOLDER: trained}, "both"
        else:
            parts = {"": merged or trained}
            layout = "merged" if merged is not None or not recipe.method.adapter() else "adapter"
    elif _is_model(p):
        parts, layout = {"": p}, "adapter" if (p / "adapter_config.json").is_file() else "merged"
    else:
        raise LorakitError(
            f"{p}: neither a run directory (no {rundir.RECIPE}), an adapter (no adapter_config.json) nor a "
            "model (no config.json)",
            doc=f"{DOC}#what-is-pushed",
        )
    every = {_join(prefix, f.name): f for prefix, d in parts.items() for f in _model_files(d)}
    files: dict[str, Path | bytes] = {k: f for k, f in every.items() if written_by_lorakit(f.name)}
    left_out = tuple(sorted(set(every) - set(files)))
    files.update(_public_adapter_configs(files))
    export_card = (
        (parts[""] / CARD).read_text(encoding="utf-8", errors="replace") if layout != "adapter" else ""
    )
    if recipe_text is None and layout != "adapter":
        # A merged export on its own: its card (card.model_card) holds the run's recipe.
        recipe_text = read_card(parts[""]).recipe_text
        recipe = _parse_recipe(recipe_text)
    shortened: list[str] = []
    if recipe_text is not None:
        recipe_text, shortened = public_recipe(recipe_text)
        recipe = _parse_recipe(recipe_text) or recipe
        files[rundir.RECIPE] = recipe_text.encode()
    images = tuple(name for name in IMAGES if run_dir is not None and (run_dir / name).is_file())
    files.update({name: run_dir / name for name in images})
    adapter_dir = parts.get(ADAPTER_SUBFOLDER, parts[""]) if layout != "merged" else None
    facts = HubFacts(
        repo_id=repo_id,
        layout=layout,
        method=recipe.method.kind if recipe is not None else _method(adapter_dir),
        base_name=public_path(_base_name(recipe, adapter_dir, parts[""])),
        base_load=public_path(_base_load(recipe, adapter_dir)),
        is_encoder_decoder=_encoder_decoder(parts[""]),
        recipe=recipe,
        recipe_text=recipe_text,
        summary=summary,
        verification=_checks(export_card),
        images=images,
    )
    card = redact(hub_card(facts))
    return Bundle(dict(sorted(files.items())), card, layout, left_out, tuple(shortened))


def _public_adapter_configs(files: dict[str, Path | bytes]) -> dict[str, bytes]:
    """adapter_config.json with peft's base_model_name_or_path, when an absolute local path, shortened to
    its last part (it names a directory of this machine that nobody else has)."""
    out = {}
    for name, f in files.items():
        if PurePosixPath(name).name != "adapter_config.json" or isinstance(f, bytes):
            continue
        config = json.loads(f.read_text())
        base = config.get("base_model_name_or_path")
        if isinstance(base, str) and is_local_path(base):
            out[name] = (
                json.dumps({**config, "base_model_name_or_path": public_path(base)}, indent=2) + "\n"
            ).encode()
    return out


@holding_run_lock
def push(
    source: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    create_pr: bool = False,
) -> PushResult:
    """Push `source` (see collect) to the Hub repository `repo_id` (OWNER/NAME) in one commit: created when
    missing (private: as a private repository), on branch `revision` (created when missing; default main),
    or as a pull request (create_pr). PublishError (exit 69) when the push does not happen; the local files
    are only read."""
    token = check_ready()
    _check_repo_id(repo_id)
    bundle = collect(source, repo_id)
    _say_what_is_pushed(repo_id, bundle)
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi(token=token)
    reached = False
    user = None
    try:
        user = api.whoami().get("name")
        reached = True
        api.create_repo(repo_id, private=True if private else None, exist_ok=True)
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        ops = [
            CommitOperationAdd(path_in_repo=name, path_or_fileobj=f if isinstance(f, bytes) else str(f))
            for name, f in bundle.files.items()
        ]
        ops.append(CommitOperationAdd(path_in_repo=CARD, path_or_fileobj=bundle.card.encode()))
        info = api.create_commit(
            repo_id,
            ops,
            commit_message=f"lorakit: {_describe(bundle.layout)}",
            revision=revision,
            create_pr=create_pr,
        )
    except Exception as e:  # the Hub's answer, or the network's: every failure becomes one line (below)
        raise _failure(e, repo_id, user, reached, api.endpoint) from e
    result = PushResult(repo_id, revision or "main", str(info.commit_url), info.pr_url, (*bundle.files, CARD))
    print(f"pushed:   {result.pr_url or result.commit_url} ({len(result.files)} files)", flush=True)
    return result


def _say_what_is_pushed(repo_id: str, bundle: Bundle) -> None:
    """Print every file the push is about to upload (with its size), and what it leaves out or changed."""
    lines = upload_lines(repo_id, bundle.files, bundle.card)
    if bundle.shortened:
        lines.append(
            "  recipe.yaml: absolute local paths shortened to their last part: " + ", ".join(bundle.shortened)
        )
    if bundle.left_out:
        lines.append("  not pushed (not written by lorakit): " + ", ".join(bundle.left_out))
    print("\n".join(lines), flush=True)


def push_after_training(recipe: Any, result: Any) -> Any:
    """output.push_to_hub: push the finished run (rank 0, after the merge). Returns `result` unchanged."""
    o = recipe.output.push_to_hub
    # The training job holds the run lock already.
    push(result.run_dir, o.repo_id, private=o.private, revision=o.revision, create_pr=o.create_pr, lock=False)
    return result


def _describe(layout: str) -> str:
    return {"adapter": "adapter", "merged": "merged model", "both": "merged model and adapter"}[layout]


def _check_repo_id(repo_id: str) -> None:
    from lorakit.recipe.schema import REPO_ID_PATTERN

    if not re.fullmatch(REPO_ID_PATTERN, repo_id):
        raise LorakitError(
            f"{repo_id!r}: a repository id is OWNER/NAME (your user or organization, then the model's name)",
            doc=f"{DOC}#what-is-pushed",
        )


def _failure(e: Exception, repo_id: str, user: str | None, reached: bool, endpoint: str) -> PublishError:
    """One line for a push that failed with `e`: what happened and what to do."""
    status = getattr(getattr(e, "response", None), "status_code", None)
    untouched = "the local files are untouched"
    if type(e).__name__ == "OfflineModeIsEnabled":
        return PublishError(f"HF_HUB_OFFLINE is set: unset it to push to {repo_id}")
    if status == 401:
        return PublishError(f"the Hub refused the token (401 Unauthorized): {_LOGIN}")
    if status == 403:
        mine = f" (e.g. {user}/{repo_id.split('/')[-1]})" if user else ""
        return PublishError(
            f"{repo_id}: the Hub refused the push (403 Forbidden): the repository belongs to another user or "
            f"organization, or the token cannot write to it; push to a repository of your own{mine}, ask its "
            "owner for write access, or open a pull request (--create-pr)"
        )
    if status is not None:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return PublishError(
            f"{repo_id}: the Hub answered {status}: {first}; nothing was committed, {untouched}"
        )
    what = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else 'no detail'}"
    if not _network(e):
        return PublishError(f"the push to {repo_id} failed ({what}): nothing was committed, {untouched}")
    if not reached:
        return PublishError(
            f"cannot reach the Hugging Face Hub at {endpoint} ({what}): check the network (and HF_ENDPOINT), "
            "then run the same push again"
        )
    return PublishError(
        f"the push to {repo_id} was interrupted ({what}): no commit was made and {untouched}; run the same "
        "push again, files already uploaded are not sent twice"
    )


def _network(e: BaseException | None) -> bool:
    """Whether `e` (or what caused it: an LFS upload wraps its error) is the network failing: an OSError, or
    the HTTP client's transport errors (connect, read, write, timeout, a dropped connection)."""
    while e is not None:
        names = {k.__name__ for k in type(e).__mro__}
        if isinstance(e, OSError) or names & {"TransportError", "ConnectionError", "TimeoutException"}:
            return True
        e = e.__cause__ or e.__context__
    return False


def _run_recipe(run_dir: Path | None) -> tuple[Any, str | None]:
    if run_dir is None:
        return None, None
    text = (run_dir / rundir.RECIPE).read_text()
    return _parse_recipe(text, str(run_dir / rundir.RECIPE)), text


def _parse_recipe(text: str | None, where: str = "the model card's recipe") -> Any:
    """The Recipe of `text`, read back as data (it loads no model and imports nothing: recipe/read_back.py),
    or None when there is none or it does not validate here (the card then says less)."""
    if text is None:
        return None
    from lorakit.recipe.read_back import read_back_recipe

    try:
        return read_back_recipe(text, where)
    except LorakitError:
        return None


def _is_model(d: Path) -> bool:
    return d.is_dir() and ((d / "adapter_config.json").is_file() or (d / "config.json").is_file())


def _model_files(d: Path) -> list[Path]:
    """The files of a saved adapter or model (its README.md is replaced by the push's card)."""
    return sorted(f for f in d.iterdir() if f.is_file() and f.name != CARD and not f.name.startswith("."))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def _adapter_config(adapter_dir: Path | None) -> dict[str, Any]:
    f = adapter_dir / "adapter_config.json" if adapter_dir is not None else None
    try:
        return json.loads(f.read_text()) if f is not None and f.is_file() else {}
    except json.JSONDecodeError:
        return {}


def _method(adapter_dir: Path | None) -> str:
    """An export without its run: lora or ia3 (by the adapter's peft_type), or full for a model."""
    if adapter_dir is None:
        return "full"
    return "ia3" if _adapter_config(adapter_dir).get("peft_type") == "IA3" else "lora"


def _base_name(recipe: Any, adapter_dir: Path | None, root: Path) -> str:
    if recipe is not None:
        return recipe.model.name_or_path
    base = _adapter_config(adapter_dir).get("base_model_name_or_path")
    return base or (json.loads((root / "config.json").read_text()).get("_name_or_path") or root.name)


def _base_load(recipe: Any, adapter_dir: Path | None) -> str:
    """What the card's PEFT snippet loads as the base: the Hub id the run trained on, else the local
    directory peft recorded (tiny:* models and local paths are not on the Hub)."""
    name = recipe.model.name_or_path if recipe is not None else None
    if name is not None and is_hub_id(name):
        return name
    return _adapter_config(adapter_dir).get("base_model_name_or_path") or name or "BASE_MODEL"


def _encoder_decoder(root: Path) -> bool:
    config = root / "config.json"
    if config.is_file():
        return bool(json.loads(config.read_text()).get("is_encoder_decoder"))
    return _adapter_config(root).get("task_type") == "SEQ_2_SEQ_LM"


def _checks(export_card: str) -> tuple[str, ...]:
    """The check lines of a merged export's card (card.model_card's Verification section)."""
    m = _CHECK.search(export_card)
    return tuple(line[2:] for line in m[1].splitlines() if line.startswith("- ")) if m else ()
