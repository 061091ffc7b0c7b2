"""ZeRO-3 on two processes takes the same LoRA step as one process, in one launch, for every dense family of
issue 45 besides the Llama-style ones test_token_weighting checks (dense_families_worker.KINDS: Gemma 2's
tied head, soft-capping on eager and alternating windows; Phi-3's fused projections; Qwen3's and OLMo 2's
q/k norms; Gemma 3 text; the encoder-decoder T5Gemma), the ranks holding different numbers of target
tokens."""

import pytest

from lorakit.engine.launch import torchrun_command
from tests.integration import dense_families_worker
from tests.integration.test_token_weighting import ROOT, _check_same_step, _run


@pytest.mark.slow
def test_zero3_on_two_ranks_steps_as_one_process_for_each_dense_family(cache_dir, tmp_path):
    dense_families_worker.main(str(cache_dir), str(tmp_path), "single")
    cmd = torchrun_command(
        2, "tests.integration.dense_families_worker", [str(cache_dir), str(tmp_path), "two_ranks"]
    )
    _run(cmd, ROOT)
    for kind in dense_families_worker.KINDS:
        _check_same_step(tmp_path, f"{kind}-two_ranks", f"{kind}-single")
