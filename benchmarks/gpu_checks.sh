#!/usr/bin/env bash
# One lease of a lent GPU machine, in one command (see benchmarks/gpu_lease_plan.md): the GPU contract tests
# (run beside the weight builds; junit XML beside the result), then issue 50's workloads in the order issue 61
# set for a short window: the first five minutes measure Llama-3-8B-shaped LoRA at sequence 4096 without
# gradient checkpointing (profiled: tok/s, MFU by lorakit's and NeMo's count, host syncs, device-busy share)
# and FLAN-T5-XL LoRA against Seq2SeqTrainer + peft (both sides profiled); then the A/B switches of the new
# paths on those shapes (workloads with `ab_of` in specs/gpu_bench.yaml), in the same window since only A/B
# inside one lease counts; then the 1B headline with its HF side, packed T5, FLAN-T5-XXL against lorakit.plan
# and 8B QLoRA with what time is left.
#
#     bash benchmarks/gpu_checks.sh OUT_DIR [TOTAL_SECONDS] [WORKLOADS] [EXTRA gpu_bench.py ARGS...]
#
# Needs ./.whl (benchmarks/fetch_gpu_wheels.sh) carried along. Everything it prints is also in OUT_DIR/lease.log.
# A second call on the still-warm machine reuses the weights built in the work directory (built.json).
set -uo pipefail
OUT_DIR="${1:?usage: gpu_checks.sh OUT_DIR [TOTAL_SECONDS] [WORKLOADS] [ARGS...]}"
TOTAL="${2:-500}"
WORKLOADS="${3:-causal_8b_lora_4k_nockpt,t5_xl_lora,causal_8b_lora_4k_nockpt_eager,t5_xl_lora_eager,t5_xl_lora_math_attention,t5_xl_lora_nockpt,causal_1b_lora,t5_xl_lora_packed,t5_xxl_lora,causal_8b_qlora_4k}"
shift $(( $# < 3 ? $# : 3 ))
EXTRA=("$@")
# Packed T5 is its own workload (t5_xl_lora_packed), so no extra sides delay the A/B switches.
(( ${#EXTRA[@]} )) || EXTRA=(--run-gpu-tests --sides lorakit,hf,lorakit_packed)
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
