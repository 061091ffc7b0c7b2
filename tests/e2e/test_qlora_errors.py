"""QLoRA's input errors through the real entry point: exit code 2, a message that says what to change."""

import os

from tests.conftest import RECIPES, ROOT, run_cli

# Stands in for an environment without bitsandbytes: `import bitsandbytes` fails as it would there.
FAKE_MISSING = 'raise ModuleNotFoundError("No module named \'bitsandbytes\'", name="bitsandbytes")\n'


def run(args, env=None):
    return run_cli("lorakit.run", *args, timeout=300, env=env)


def test_qlora_without_bitsandbytes_names_the_extra(cache_dir, tmp_path):
    fake = tmp_path / "site" / "bitsandbytes"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_MISSING)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), str(ROOT)])}
    run_dir = tmp_path / "run"
    proc = run(
        [
            RECIPES / "quickstart_causal.yaml",
            "method.kind=qlora",
            f"data.cache_dir={cache_dir}",
            f"output.dir={run_dir}",
        ],
        env,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "method.kind qlora needs bitsandbytes" in proc.stderr
    assert 'pip install "lorakit[qlora]"' in proc.stderr
    assert "Traceback" not in proc.stderr and not run_dir.exists()


def test_full_finetuning_of_a_4bit_base_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    proc = run(
        [RECIPES / "quickstart.yaml", "method.kind=full", "method.quant_type=nf4", f"output.dir={run_dir}"]
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "method.quant_type: full fine-tuning cannot train a 4-bit base" in proc.stderr
    assert "use method.kind: qlora" in proc.stderr
    assert "Traceback" not in proc.stderr and not run_dir.exists()
