"""transformers' "Token indices sequence length is longer than the specified maximum" line stays out of the
console: lorakit tokenizes whole rows on purpose, applies data.overlong and reports the counts itself."""

import json
import logging

import pytest

from lorakit.data import prepare_data
from lorakit.model import load_config, load_tokenizer
from lorakit.recipe import recipe_from_dict
from tests.conftest import tiny_recipe_dict

WARNING = "Token indices sequence length is longer than the specified maximum"


@pytest.fixture
def transformers_log(tmp_path):
    """A function returning what transformers has logged so far in the test, from this process and from
    the worker processes datasets.map forks to tokenize (they inherit the handler and append to its file).
    transformers' library logger does not propagate to the root logger, so caplog would see none."""
    path = tmp_path / "transformers.log"
    handler = logging.FileHandler(path, mode="a", delay=False)
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        yield lambda: (handler.flush(), path.read_text())[1]
    finally:
        logger.removeHandler(handler)
        handler.close()


def _long_rows(tmp_path, fmt: str) -> str:
    """train/validation.jsonl whose first rows are far longer than the tiny models' 512 tokens."""
    d = tmp_path / "long"
    d.mkdir()
    long_text = " ".join(f"storm{i % 37} hit village{i % 11}." for i in range(400))
    rows = [{"article": long_text, "highlights": "A storm hit."}] + [
        {"article": f"Short article {i}.", "highlights": f"Short {i}."} for i in range(7)
    ]
    if fmt == "completion":
        rows = [{"text": r["article"]} for r in rows]
    for split in ("train", "validation"):
        (d / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(d)


@pytest.mark.parametrize(
    "model,fmt", [("tiny:t5", "instruction"), ("tiny:llama", "instruction"), ("tiny:llama", "completion")]
)
def test_overlong_rows_are_counted_without_the_tokenizer_warning(model, fmt, tmp_path, transformers_log):
    data = {"source": _long_rows(tmp_path, fmt), "format": fmt, "max_samples": None, "max_eval_samples": None}
    sections = {"model": {"name_or_path": model}, "data": data}
    if model == "tiny:llama":
        data.update(max_length=128)
    if fmt == "completion":
        data.update(text_column="text")
        sections["eval"] = {"generate": False}
    recipe = recipe_from_dict(tiny_recipe_dict(tmp_path / "cache", tmp_path / "run", **sections))
    source, config = load_config(recipe)
    tok = load_tokenizer(recipe, source)
    assert tok.model_max_length == 512  # the tiny tokenizers' limit, which the long rows exceed
    prepared = prepare_data(recipe, tok, config)
    assert WARNING not in transformers_log()
    # The long row was handled by the overlong policy (truncate) and counted.
    assert prepared.stats["overlong"]["truncated"] >= 1

    # The guard is meaningful: the same tokenizer called the default way still warns.
    tok(" ".join(["storm"] * 2000))
    assert WARNING in transformers_log()
