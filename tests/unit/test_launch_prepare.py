"""The launcher (python -m lorakit.run, lorakit.train with several processes) tokenizes the data before it
starts torchrun, so no rank tokenizes while the others wait in a collective (docs/faults.md, a stuck
collective): when the workers start, their prepare reads the cache."""

from __future__ import annotations

import lorakit
import lorakit.api as api
from lorakit import rundir
from lorakit.data import prepare
from tests.conftest import tiny_recipe


def test_the_launcher_prepares_the_data_before_it_starts_the_workers(
    cache_dir, tmp_path, monkeypatch, capsys
):
    # max_samples no other test uses: the data cache starts cold for this recipe.
    recipe = tiny_recipe(
        cache_dir,
        tmp_path / "run",
        data={"max_samples": 29},
        distributed={"num_processes": 2, "zero_stage": 3},
        output={"report_to": []},
    )
    seen = {}

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("a worker read the raw rows: the launcher had not prepared the data")

    def workers(cmd, env, started=None):
        # Stands in for torchrun: what each worker's prepare finds when it starts.
        seen["launched"] = "lorakit.run" in cmd and "--worker" in cmd
        with monkeypatch.context() as m:
            m.setattr(prepare, "load_rows", no_tokenizing)
            seen["cache_hit"] = lorakit.prepare(recipe).cache_hit
        rundir.write_json(tmp_path / "run" / "summary.json", {"status": "faked"})
        return 0

    monkeypatch.setattr(api, "_run_forwarding_signals", workers)
    result = lorakit.train(recipe)
    assert result.summary == {"status": "faked"}
    assert seen == {"launched": True, "cache_hit": True}
    assert "tokenized and cached" in capsys.readouterr().out  # cold before the launcher ran


def test_the_launcher_prepares_preference_pairs_too(cache_dir, tmp_path, monkeypatch):
    recipe = tiny_recipe(
        cache_dir,
        tmp_path / "run",
        model={"name_or_path": "tiny:llama"},
        data={
            "source": "builtin:preference_pairs",
            "input_column": "question",
            "prompt_template": "{input}\n",
            "max_samples": 31,
        },
        train={"objective": "dpo"},
        eval={"generate": False},
        distributed={"num_processes": 2, "zero_stage": 3},
        output={"report_to": []},
    )

    def workers(cmd, env, started=None):
        assert lorakit.prepare(recipe).cache_hit
        rundir.write_json(tmp_path / "run" / "summary.json", {})
        return 0

    monkeypatch.setattr(api, "_run_forwarding_signals", workers)
    lorakit.train(recipe)
