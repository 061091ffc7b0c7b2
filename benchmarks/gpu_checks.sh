#!/usr/bin/env bash
# One lease of a lent GPU machine, in one command (see benchmarks/gpu_lease_plan.md): the GPU contract tests,
# the doctor on both quickstarts, then the headline benchmark with the time that is left.
#
#     bash benchmarks/gpu_checks.sh OUT_DIR [TOTAL_SECONDS]
#
# Needs ./.whl (benchmarks/fetch_gpu_wheels.sh) carried along. Everything it prints is also in OUT_DIR/lease.log.
set -uo pipefail
OUT_DIR="${1:?usage: gpu_checks.sh OUT_DIR [TOTAL_SECONDS]}"
TOTAL="${2:-540}"
mkdir -p "$OUT_DIR"
exec > >(tee "$OUT_DIR/lease.log") 2>&1

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TORCH_CUDA_ARCH_LIST=9.0 \
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import torch,transformers,peft,deepspeed,datasets,pydantic,bitsandbytes,accelerate as a;print('torch',torch.__version__,torch.version.cuda,'transformers',transformers.__version__,'peft',peft.__version__,'deepspeed',deepspeed.__version__,'datasets',datasets.__version__,'pydantic',pydantic.VERSION,'bnb',bitsandbytes.__version__,'accelerate',a.__version__)"

echo "===== [$SECONDS s] GPU contract tests"
timeout 200 python3 -m pytest -q -rs -p no:cacheprovider -s --durations=10 tests/gpu 2>&1 | tail -60

for q in "quickstart_causal:" "quickstart:--quick"; do
    name="${q%%:*}"
    echo "===== [$SECONDS s] doctor $name"
    timeout 100 python3 -m lorakit.doctor "recipes/$name.yaml" distributed.num_processes=1 \
        "data.cache_dir=/tmp/lk-cache" ${q#*:} --output "/tmp/doctor-$name"
    echo "doctor exit $?"
    cp "/tmp/doctor-$name/doctor.json" "$OUT_DIR/doctor_$name.json" 2>/dev/null
done

left=$((TOTAL - SECONDS - 15))
echo "===== [$SECONDS s] benchmark causal_1b_lora, budget ${left} s"
if [ "$left" -gt 150 ]; then
    python3 benchmarks/gpu_bench.py --workloads causal_1b_lora --budget-seconds "$left" \
        --output "$OUT_DIR/gpu_h200_part1.json" --work-dir /tmp/gb --note "lease of 2026-11-26, after the checks"
else
    echo "skipped: too little time left"
fi
echo "===== [$SECONDS s] done"
