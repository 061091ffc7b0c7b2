"""lorakit.generate and python -m lorakit.generate: a trained run's model on new inputs with the run's own
prompt template, from its run directory, its adapter directory or its merged export alike; bad input exits 2
with a message naming the line or the directory, and writes nothing."""

import json
import shutil

import pyarrow.parquet as pq
import pytest
import torch

import lorakit
from lorakit import rundir
from lorakit.data.samples import builtin_dataset_dir
from lorakit.errors import DataError, InferenceError
from tests.conftest import run_cli
from tests.e2e.test_quickstart import noise_lines

LABELS = ["entailment", "neutral", "contradiction"]


def eval_rows(n: int) -> list[dict]:
    """The first n rows of the run's eval split (validation_mismatched), as a user would give them."""
    table = pq.read_table(builtin_dataset_dir("mnli_sample") / "validation_mismatched.parquet")
    return [
        {"id": r["idx"], "premise": r["premise"], "hypothesis": r["hypothesis"]}
        for r in table.to_pylist()[:n]
    ]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def generate_cli(*args, stdin=None):
    # Fresh: its console is checked for what the imports print too.
    return run_cli("lorakit.generate", *args, timeout=300, input=stdin, fresh=True)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("inputs") / "mnli.jsonl", eval_rows(24))


# Two next-token logits closer than this are a tie under bf16 rounding (bf16 spaces logits of 8 to 16 by
# 0.0625): greedy decoding may take either.
NEAR_TIE = 0.125


def greedy_margins(source, inputs) -> list[float]:
    """Per input row, the smallest gap between the two best next-token logits along the greedy path of the
    model at `source` (each row alone, 8 new tokens at most): how near the row's output is to a tie."""
    from lorakit.inference.generation import Prompter, _encode
    from lorakit.inference.model import find_trained, load_model

    trained = find_trained(source)
    model = load_model(trained)
    rows = Prompter(trained.recipe.data, writes_label=bool(trained.labels)).rows(inputs)
    margins = []
    for ids in _encode(rows, model, trained.recipe.data)[1]:
        x = torch.tensor([ids])
        with torch.no_grad():
            out = model.module.generate(
                input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False,
                output_scores=True, return_dict_in_generate=True,
            )  # fmt: skip
        gaps = [float(top[0] - top[1]) for top in (step[0].float().topk(2).values for step in out.scores)]
        margins.append(min(gaps))
    return margins


def test_run_dir_adapter_dir_and_merged_export_generate_the_same(mnli_run, mnli_merged, inputs, tmp_path):
    summary = rundir.read_summary(mnli_run)
    outputs = {}
    for name, source in {"run": mnli_run, "adapter": mnli_run / "adapter", "merged": mnli_merged}.items():
        # The merged export lies outside the run: its template and labels come from its model card, its
        # default length cannot come from summary.json, so the length is given.
        result = lorakit.generate(source, inputs, output=tmp_path / f"{name}.jsonl", max_new_tokens=8)
        assert read_jsonl(tmp_path / f"{name}.jsonl") == result.records and result.labels == LABELS
        outputs[name] = result.records
    assert outputs["run"] == outputs["adapter"]
    # The merged export folds the adapter into bf16 weights: other rounding than base + adapter. Prompts and
    # templates must be the same for every row; an output may differ only on a row whose greedy path passes
    # a near-tie (8 steps of a briefly trained classifier leave many: 3 of 24 rows seen, margins 0.03-0.05).
    assert [r["prompt"] for r in outputs["adapter"]] == [r["prompt"] for r in outputs["merged"]]
    flips = [i for i, (a, m) in enumerate(zip(outputs["adapter"], outputs["merged"], strict=True)) if a != m]
    margins = greedy_margins(mnli_run, inputs)
    assert all(margins[i] < NEAR_TIE for i in flips), {i: margins[i] for i in flips}
    assert len(flips) < len(margins) // 4, flips  # a handful of near-ties, not a different model
    records = outputs["run"]
    rows = eval_rows(24)
    assert [{k: r[k] for k in ("id", "premise", "hypothesis")} for r in records] == rows  # input order
    assert records[0]["prompt"] == f"mnli hypothesis: {rows[0]['hypothesis']} premise: {rows[0]['premise']}"
    assert all(r["label"] == (r["output"] if r["output"] in LABELS else None) for r in records)
    # The same rows were the run's eval split: generate reproduces what training's eval generated.
    trained = [json.loads(line)["prediction"] for line in open(mnli_run / "eval_predictions.jsonl")]
    # Training's eval runs packed rows through the fused T5 kernels (compiled FlexAttention) under ZeRO-3 in
    # bf16, generate runs each input alone through SDPA: the same model, other rounding, so a near-tie between
    # two label words may flip (1 of 24 seen). A confident row that differs is a real difference in prompts or
    # decoding.
    differ = [i for i, (r, t) in enumerate(zip(records, trained, strict=True)) if r["output"] != t]
    assert all(margins[i] < NEAR_TIE for i in differ), {i: margins[i] for i in differ}
    assert len(differ) < len(margins) // 4, differ
    # Without --max-new-tokens, a run directory generates up to its target cap, as its eval did.
    default = lorakit.generate(mnli_run, eval_rows(2))
    assert default.max_new_tokens == summary["data"]["max_target_length"] and default.output is None
    assert [r["output"] for r in default.records] == trained[:2]


def test_a_bf16_run_generates_with_the_products_it_trained_with(mnli_run, monkeypatch):
    """On this CPU a bf16 run's linear layers form their products as training's evaluation did
    (lorakit.model.cpu_products; summary.json's matmul)."""
    from lorakit.model import cpu_products

    changed, original = [], cpu_products.use_fp32_products
    monkeypatch.setattr(
        cpu_products, "use_fp32_products", lambda *a: changed.append(original(*a)) or changed[-1]
    )
    lorakit.generate(mnli_run, eval_rows(1), max_new_tokens=1)
    assert changed == [rundir.read_summary(mnli_run)["matmul"] == "fp32"]


def test_a_model_without_recipe_takes_text_lines_as_given(mnli_run, mnli_merged, inputs, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(mnli_merged, bare, ignore=shutil.ignore_patterns("README.md"))  # no card: no recipe
    with_template = lorakit.generate(mnli_merged, inputs, max_new_tokens=8).records
    lines = tmp_path / "prompts.txt"
    lines.write_text("".join(r["prompt"] + "\n" for r in with_template))
    result = lorakit.generate(bare, lines, max_new_tokens=8)
    assert result.labels is None and "label" not in result.records[0]
    assert [r["input"] for r in result.records] == [r["prompt"] for r in result.records]
    assert [r["output"] for r in result.records] == [r["output"] for r in with_template]
    # The base model directory (no adapter) answers the same prompts otherwise: the outputs are the adapter's.
    base = lorakit.generate(rundir.read_summary(mnli_run)["model_source"], lines, max_new_tokens=8)
    assert [r["output"] for r in base.records] != [r["output"] for r in result.records]


def test_causal_adapter_decodes_only_the_continuation(cache_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.unit.test_merge_checks import make_adapter

    adapter = make_adapter(cache_dir, tmp_path / "adapter")  # tiny:llama, no run directory, no recipe
    texts = ["The market opened higher on", "Officials said"]
    records = lorakit.generate(adapter, texts, max_new_tokens=6, dtype="float32").records
    base_dir = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    tok = AutoTokenizer.from_pretrained(base_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter).eval()
    for text, record in zip(texts, records, strict=True):
        ids = tok(text, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
        continuation = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        assert record["output"] == continuation and record["prompt"] == text
        assert not record["output"].startswith(text)


def test_bad_input_is_refused_before_loading_and_writes_nothing(mnli_run, tmp_path):
    out = tmp_path / "out.jsonl"
    missing = write_jsonl(tmp_path / "missing.jsonl", [*eval_rows(2), {"premise": "P.", "id": 3}])
    with pytest.raises(DataError) as e:
        lorakit.generate(mnli_run, missing, output=out)
    assert "missing.jsonl line 3: column 'hypothesis' is missing" in str(e.value)
    assert "the row has the columns ['id', 'premise']" in str(e.value)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="no input rows"):
        lorakit.generate(mnli_run, tmp_path / "empty.jsonl", output=out)
    with pytest.raises(InferenceError, match="neither a run directory"):
        lorakit.generate(tmp_path, eval_rows(1), output=out)
    with pytest.raises(InferenceError, match="no such directory"):
        lorakit.generate(tmp_path / "nowhere", eval_rows(1), output=out)
    with pytest.raises(DataError, match="not a JSON object, but the prompt template"):
        lorakit.generate(mnli_run, ["a plain line"], output=out)
    with pytest.raises(InferenceError, match="--batch-size 0: must be a whole number >= 1"):
        lorakit.generate(mnli_run, eval_rows(1), output=out, batch_size=0)
    if not torch.cuda.is_available():
        with pytest.raises(InferenceError, match="--device 'cuda': this machine has no CUDA GPU"):
            lorakit.generate(mnli_run, eval_rows(1), output=out, device="cuda")
    assert not out.exists()


def test_cli_reads_stdin_writes_stdout_and_exits_2_on_bad_input(mnli_run, inputs, tmp_path):
    proc = generate_cli(mnli_run, "--input", "-", stdin=open(inputs).read())
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["id"] for r in records] == [r["id"] for r in eval_rows(24)]
    assert set(records[0]) == {"id", "premise", "hypothesis", "prompt", "output", "label"}
    assert "trained with the recipe in the run directory" in proc.stderr and noise_lines(proc) == []

    out = tmp_path / "out.jsonl"
    missing = write_jsonl(tmp_path / "missing.jsonl", [{"premise": "P."}])
    proc = generate_cli(mnli_run, "--input", missing, "--output", out)
    assert proc.returncode == 2 and "error: " in proc.stderr and "Traceback" not in proc.stderr
    assert (
        "line 1: column 'hypothesis' is missing" in proc.stderr
        and "see docs/inference.md#inputs" in proc.stderr
    )
    proc = generate_cli(tmp_path / "nowhere", "--input", missing, "--output", out)
    assert proc.returncode == 2 and "no such directory" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()
