#!/usr/bin/env bash
# One lease of a lent GPU machine, in one command (see benchmarks/gpu_lease_plan.md): the GPU contract tests
# (junit XML beside the result), then issue 50's workloads in order of value with the time that is left:
# FLAN-T5-XL LoRA against Seq2SeqTrainer + peft, Llama-3-8B-shaped LoRA at sequence 4096 (without and with
# gradient checkpointing), and FLAN-T5-XXL LoRA at the headline recipe's shape on one GPU.
#
#     bash benchmarks/gpu_checks.sh OUT_DIR [TOTAL_SECONDS] [WORKLOADS]
#
# Needs ./.whl (benchmarks/fetch_gpu_wheels.sh) carried along. Everything it prints is also in OUT_DIR/lease.log.
set -uo pipefail
OUT_DIR="${1:?usage: gpu_checks.sh OUT_DIR [TOTAL_SECONDS] [WORKLOADS]}"
TOTAL="${2:-540}"
WORKLOADS="${3:-t5_xl_lora,causal_8b_lora_4k_nockpt,t5_xxl_lora,causal_8b_lora_4k}"
mkdir -p "$OUT_DIR"
exec > >(tee "$OUT_DIR/lease.log") 2>&1

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TORCH_CUDA_ARCH_LIST=9.0 \
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import torch,transformers,peft,deepspeed,datasets,pydantic,bitsandbytes,accelerate as a;print('torch',torch.__version__,torch.version.cuda,'transformers',transformers.__version__,'peft',peft.__version__,'deepspeed',deepspeed.__version__,'datasets',datasets.__version__,'pydantic',pydantic.VERSION,'bnb',bitsandbytes.__version__,'accelerate',a.__version__)"
echo "git revision: $(git rev-parse HEAD 2>/dev/null || echo unknown)"

# The setup worker (matmul rate, fused Adam, random weights of every model), then tests/gpu, then the workloads;
# the budget guard skips (and reports) sides that no longer fit. The JSON is rewritten after every workload.
left=$((TOTAL - SECONDS - 10))
echo "===== [$SECONDS s] gpu_bench: tests/gpu, then $WORKLOADS, budget ${left} s"
python3 benchmarks/gpu_bench.py --run-gpu-tests --workloads "$WORKLOADS" --budget-seconds "$left" \
    --output "$OUT_DIR/gpu_lease.json" --work-dir /tmp/gb --note "lease of $(date -u +%F), gpu_checks.sh"
echo "===== [$SECONDS s] done (exit $?)"
