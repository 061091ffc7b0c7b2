"""Safety: recipes are data (safe YAML), base weights load from safetensors unless model.allow_pickle, model
code runs only with model.trust_remote_code, and the weights lorakit writes are safetensors.

That a training run writes nothing outside output.dir and data.cache_dir is shown by the one-node run of
tests/integration/test_multinode.py (fresh HOME, TMPDIR and working directory), which also checks its
adapter."""

import shutil
from pathlib import Path

import pytest
import torch

from lorakit.errors import RecipeError
from lorakit.model import build_model, load_config
from lorakit.model import source as source_module
from lorakit.recipe import load_recipe
from lorakit.testing import resolve_model_source
from tests.conftest import tiny_recipe

PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".pkl", ".ckpt"}


def test_recipe_yaml_cannot_build_objects(tmp_path):
    marker = tmp_path / "ran"
    recipe = tmp_path / "evil.yaml"
    recipe.write_text(f"model: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(recipe)
    assert not marker.exists()


def _llama_recipe(cache_dir, tmp_path, **model):
    return tiny_recipe(cache_dir, tmp_path / "run", model={"name_or_path": "tiny:llama", **model})


@pytest.fixture
def pickled_llama(cache_dir, tmp_path) -> Path:
    """tiny:llama with its weights in pytorch_model.bin (a pickle) and no safetensors, as older hub
    checkpoints ship. transformers 5.x always saves safetensors, so the pickle is written with torch.save."""
    from transformers import AutoModelForCausalLM

    source = Path(resolve_model_source("tiny:llama", cache_dir))
    out = tmp_path / "pickled"
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(source)
    torch.save(model.state_dict(), out / "pytorch_model.bin")
    return out


def test_pickled_weights_need_allow_pickle(cache_dir, tmp_path, pickled_llama, monkeypatch):
    recipe = _llama_recipe(cache_dir, tmp_path, name_or_path=str(pickled_llama))
    # Refused before any data is tokenized, naming the file and the flag.
    with pytest.raises(
        RecipeError, match=r"pickle files only \(pytorch_model\.bin\).*model\.allow_pickle: true"
    ):
        load_config(recipe)
    # A hub checkpoint cannot be looked at beforehand: from_pretrained(use_safetensors=True) refuses it.
    monkeypatch.setattr(source_module, "check_weight_files", lambda recipe, source: None)
    with pytest.raises(RecipeError, match=r"no safetensors weights found.*model\.allow_pickle: true"):
        build_model(recipe)
    monkeypatch.undo()
    allowed = _llama_recipe(cache_dir, tmp_path, name_or_path=str(pickled_llama), allow_pickle=True)
    built = build_model(allowed)
    reference = build_model(_llama_recipe(cache_dir, tmp_path))
    name = "base_model.model.model.embed_tokens.weight"
    assert torch.equal(built.model.get_parameter(name), reference.model.get_parameter(name))


def test_remote_code_never_runs_without_trust_remote_code(cache_dir, tmp_path):
    repo = tmp_path / "custom"
    repo.mkdir()
    marker = tmp_path / "remote-code-ran"
    (repo / "config.json").write_text(
        '{"model_type": "lorakit_custom", "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"}}'
    )
    (repo / "configuration_custom.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    recipe = _llama_recipe(cache_dir, tmp_path, name_or_path=str(repo))
    with pytest.raises(RecipeError, match=r"ships its own Python code.*model\.trust_remote_code: true"):
        load_config(recipe)
    assert not marker.exists()


def test_loader_flags_reach_every_from_pretrained(cache_dir, tmp_path, monkeypatch):
    """trust_remote_code goes to the config, tokenizer and model loaders as the recipe says (False unless
    set), and the model loads from safetensors only unless model.allow_pickle."""
    calls = []
    # The config and tokenizer load in lorakit.model.source, the model in lorakit.model.build through the
    # auto class its family resolves (lorakit.model.families.model_class): the spy sits on the class itself.
    import transformers

    loaders = {
        "AutoConfig": source_module,
        "AutoTokenizer": source_module,
        "AutoModelForCausalLM": transformers,
    }
    for name, module in loaders.items():
        cls = getattr(module, name)
        real = cls.from_pretrained

        def spy(*args, _name=name, _real=real, **kwargs):
            calls.append((_name, kwargs))
            return _real(*args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", spy)
    build_model(_llama_recipe(cache_dir, tmp_path))
    assert {name for name, _ in calls} == {"AutoConfig", "AutoTokenizer", "AutoModelForCausalLM"}
    assert all(kwargs["trust_remote_code"] is False for _, kwargs in calls)
    assert [k["use_safetensors"] for n, k in calls if n == "AutoModelForCausalLM"] == [True]
    calls.clear()
    build_model(_llama_recipe(cache_dir, tmp_path, trust_remote_code=True, allow_pickle=True))
    assert all(kwargs["trust_remote_code"] is True for _, kwargs in calls)
    assert [k["use_safetensors"] for n, k in calls if n == "AutoModelForCausalLM"] == [None]


def test_full_fine_tuning_saves_safetensors(cache_dir, tmp_path):
    import lorakit

    recipe = tiny_recipe(
        cache_dir,
        tmp_path / "run",
        method={"kind": "full"},
        train={"max_steps": 1},
        eval={"enabled": False},
    )
    summary = lorakit.train(recipe).summary
    model_dir = Path(summary["model_dir"])
    assert (model_dir / "model.safetensors").is_file()
    # DeepSpeed's resumable checkpoints are its own torch.save files, read back only by lorakit's resume.
    run_dir = model_dir.parent
    assert [
        p for p in run_dir.rglob("*") if p.suffix in PICKLE_SUFFIXES and "checkpoints" not in p.parts
    ] == []
