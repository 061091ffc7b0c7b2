"""lorakit doctor's parts: stale build locks, a broken flash-attn reported (not raised), the chunked-loss
contract and its failure when the loss is off, the GPU peak table, the report files, the all_reduce
worker's arithmetic, and the CLI's errors."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from lorakit.doctor import contracts, env
from lorakit.doctor.result import DoctorReport, failed, passed, skipped
from lorakit.doctor.speed import peak_tflops
from lorakit.engine import extension_locks
from lorakit.engine.extension_locks import stale_locks


def _lock(path, age_seconds: float):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    old = time.time() - age_seconds
    os.utime(path, (old, old))
    return path


def test_stale_locks_default_root_follows_torch_extensions_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = _lock(tmp_path / "cpu_adam" / "lock", 3600)
    assert extension_locks.extensions_root() == tmp_path
    assert stale_locks() == [lock]  # no process works in a temporary directory
    result = env.stale_locks()
    assert result.status == "fail" and str(lock) in result.action


@pytest.mark.parametrize(
    "error",
    [
        "ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c10')",
        "OSError('libcudart.so.12: cannot open')",
    ],
)
def test_a_flash_attn_that_does_not_import_is_reported_not_raised(tmp_path, monkeypatch, error):
    package = tmp_path / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text(f"raise {error}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    result = env.flash_attn()
    assert result.status == "fail" and "does not import" in result.detail
    assert error.split("(")[0] in result.detail and "model.attention: sdpa" in result.action


def test_bitsandbytes_branch_is_reported():
    result = env.bitsandbytes()
    assert result.passed
    if result.data.get("installed", True):
        assert "branch" in result.detail
        if not torch.cuda.is_available():
            assert isinstance(result.data["avx512_bf16"], bool)


@pytest.mark.parametrize("fast_kernel", [True, False], ids=["avx512-bf16", "avx2"])
def test_cpu_bf16_matmul_reports_the_branch_a_run_takes_and_fails_a_bad_setting(monkeypatch, fast_kernel):
    from lorakit.model import cpu_products

    monkeypatch.setattr(cpu_products, "fast_bf16_kernel", lambda: fast_kernel)
    monkeypatch.delenv(cpu_products.FORCE, raising=False)
    result = env.cpu_matmul()
    assert result.passed and result.data["products"] == ("native" if fast_kernel else "fp32")
    assert ("products formed in fp32" in result.detail) is not fast_kernel
    monkeypatch.setenv(cpu_products.FORCE, "fp32")
    result = env.cpu_matmul()
    assert result.data["products"] == "fp32" and "LORAKIT_CPU_BF16_MATMUL=fp32" in result.detail
    monkeypatch.setenv(cpu_products.FORCE, "fast")
    result = env.cpu_matmul()
    assert result.status == "fail" and "'fast'" in result.detail and "exit 2" in result.meaning


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_ce_contract_passes(dtype):
    result = contracts.chunked_ce(3000, dtype)
    assert result.passed and result.data["loss_diff"] < 1e-5, result.detail


def test_chunked_ce_contract_fails_and_says_what_it_means_when_the_loss_is_off(monkeypatch):
    real = contracts.loss_fns.token_loss_sum
    monkeypatch.setattr(contracts.loss_fns, "token_loss_sum", lambda *a, **k: 1.02 * real(*a, **k))
    result = contracts.chunked_ce(3000, torch.float32)
    assert result.status == "fail" and result.name == "chunked CE == full CE"
    assert "wrong loss" in result.meaning and result.action


def test_peaks_of_known_devices():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("NVIDIA L40S") == 362.0 and peak_tflops("NVIDIA L4") == 121.0
    assert peak_tflops("Some Future GPU") is None and peak_tflops(None) is None


def test_report_files_and_exit_verdict(tmp_path):
    checks = [
        passed("environment", "python + torch", "Python 3"),
        skipped("speed", "all_reduce", "one device"),
    ]
    report = DoctorReport("recipes/x.yaml", True, list(checks), seconds=1.0, versions={"torch": "2"})
    assert report.ok
    checks.append(failed("contracts", "packed == alone", "diff 0.4", "packed attention leaked", "use sdpa"))
    report = DoctorReport("recipes/x.yaml", False, checks, seconds=1.0, versions={"torch": "2"})
    assert not report.ok and [c.name for c in report.failures] == ["packed == alone"]
    json_path, md_path = report.write(tmp_path / "out")
    data = json.loads(json_path.read_text())
    assert data["ok"] is False and [c["status"] for c in data["checks"]] == ["pass", "skip", "fail"]
    md = md_path.read_text()
    assert "## Failed: contracts/packed == alone" in md and "What to do: use sdpa" in md
    table = report.table()
    assert "FAILED contracts/packed == alone" in table and "means: packed attention leaked" in table


def test_the_doctor_package_is_callable_after_import():
    import lorakit
    import lorakit.doctor

    assert callable(lorakit.doctor)
    report = lorakit.doctor(None, sections=("environment",))
    assert {c.section for c in report.checks} == {"environment"}


def test_a_failed_check_exits_1_and_says_what_to_do(tmp_path, monkeypatch, capsys):
    from lorakit.doctor.cli import main

    # A build lock left by a killed DeepSpeed op build, an hour old: the environment check fails.
    lock = _lock(tmp_path / "extensions" / "cpu_adam" / "lock", 3600)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    assert main(["--output", str(tmp_path / "doctor")]) == 1
    out = capsys.readouterr().out
    assert "FAILED environment/extension locks" in out and f"rm {lock}" in out
    assert "SKIP  contracts" in out  # no recipe: the environment only
    assert json.loads((tmp_path / "doctor" / "doctor.json").read_text())["ok"] is False


def test_cli_refuses_bad_input(tmp_path, capsys):
    from lorakit.doctor.cli import main

    assert main(["--devices", "0"]) == 2
    assert main([str(tmp_path / "missing.yaml"), "--output", str(tmp_path)]) == 2
    assert "error:" in capsys.readouterr().err
