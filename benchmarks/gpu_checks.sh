#!/usr/bin/env bash
# One lease of a lent GPU machine, in one command (see benchmarks/gpu_lease_plan.md): the GPU contract tests
# (run beside the weight builds; junit XML beside the result), then issue 50's workloads in order of value with
# the time that is left (the third lease's results decided the order): FLAN-T5-XL LoRA against Seq2SeqTrainer +
# peft with the packed T5 side (profiled), the 1B LoRA headline with its HF side (profiled), Llama-3-8B-shaped
# LoRA at sequence 4096 without gradient checkpointing (profiled), FLAN-T5-XXL LoRA on one GPU (peak against
# lorakit.plan), and 8B QLoRA.
#
#     bash benchmarks/gpu_checks.sh OUT_DIR [TOTAL_SECONDS] [WORKLOADS] [EXTRA gpu_bench.py ARGS...]
#
# Needs ./.whl (benchmarks/fetch_gpu_wheels.sh) carried along. Everything it prints is also in OUT_DIR/lease.log.
# A second call on the still-warm machine reuses the weights built in the work directory (built.json).
set -uo pipefail
OUT_DIR="${1:?usage: gpu_checks.sh OUT_DIR [TOTAL_SECONDS] [WORKLOADS] [ARGS...]}"
TOTAL="${2:-500}"
WORKLOADS="${3:-t5_xl_lora,causal_1b_lora,causal_8b_lora_4k_nockpt,t5_xxl_lora,causal_8b_qlora_4k}"
shift $(( $# < 3 ? $# : 3 ))
EXTRA=("$@")
(( ${#EXTRA[@]} )) || EXTRA=(--run-gpu-tests --extra-sides --sides lorakit,hf,lorakit_packed)
mkdir -p "$OUT_DIR"
exec > >(tee "$OUT_DIR/lease.log") 2>&1

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TORCH_CUDA_ARCH_LIST=9.0 \
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import torch,transformers,peft,deepspeed,datasets,pydantic,bitsandbytes,accelerate as a;print('torch',torch.__version__,torch.version.cuda,'transformers',transformers.__version__,'peft',peft.__version__,'deepspeed',deepspeed.__version__,'datasets',datasets.__version__,'pydantic',pydantic.VERSION,'bnb',bitsandbytes.__version__,'accelerate',a.__version__)"
echo "git revision: $(git rev-parse HEAD 2>/dev/null || echo unknown)"

# 46 GB of random weights (XXL, 8B, XL, 1B): in RAM when /dev/shm has room, which writes them faster than the disk.
WORK=/tmp/gb
shm_gib=$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
(( ${shm_gib:-0} >= 70 )) && WORK=/dev/shm/gb
echo "work directory: $WORK (/dev/shm: ${shm_gib:-?} GiB free); disk: $(df -h --output=avail /tmp | tail -1)"

left=$((TOTAL - SECONDS - 10))
echo "===== [$SECONDS s] gpu_bench: $WORKLOADS ${EXTRA[*]}, budget ${left} s"
python3 benchmarks/gpu_bench.py --workloads "$WORKLOADS" "${EXTRA[@]}" --budget-seconds "$left" \
    --output "$OUT_DIR/gpu_lease.json" --work-dir "$WORK" --note "lease of $(date -u +%F), gpu_checks.sh"
echo "===== [$SECONDS s] done (exit $?)"
