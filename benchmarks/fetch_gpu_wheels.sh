#!/usr/bin/env bash
# Fill ./.whl with exactly the wheels the lent H200 machine lacks for lorakit and benchmarks/gpu_bench.py.
#
#     bash benchmarks/fetch_gpu_wheels.sh          # from the repository root or anywhere; needs pip + PyPI
#
# What that machine has and lacks is written down in benchmarks/gpu_lease_plan.md ("The lent machine"): it
# lacks deepspeed, pydantic, datasets and bitsandbytes (and their own missing needs below); peft and fsspec
# are carried to pin the versions lorakit is tested with. Everything travels with the working tree, which may
# not exceed 64 MiB in all; the script checks. On the machine:
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#         --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.whl"
PY="${PYTHON:-python3}"
LIMIT=$((64 * 1024 * 1024))

# One version of each; --no-deps, so every needed package is named here.
BINARY=(
    "pydantic==2.13.4"
    "pydantic_core==2.46.4"       # cp312 manylinux build
    "annotated_types==0.8.0"
    "typing_inspection==0.4.5"
    "typing_extensions==4.16.0"   # pydantic_core needs >= 4.14.1 (Sentinel); the image's version is not recorded
    "hjson==3.1.0"                # deepspeed
    "datasets==5.2.0"
    "dill==0.4.1"                 # datasets
    "multiprocess==0.70.19"       # datasets (py312 wheel)
    "fsspec==2026.9.0"            # datasets' upper bound
    "peft==0.21.2"
    "bitsandbytes==0.50.2"        # QLoRA; slimmed below to the CUDA 13 libraries
)
DEEPSPEED="deepspeed==0.19.8"    # sdist only on PyPI: built here into a pure-python wheel

PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

rm -rf "$DEST"
mkdir -p "$DEST"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

"$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$DEST" "${BINARY[@]}"

# DeepSpeed builds no CUDA ops into the wheel (DS_BUILD_OPS=0): on the GPU machine it JIT-compiles the ones it
# uses (fused Adam) with the image's nvcc and ninja, once per machine, into ~/.cache/torch_extensions.
"$PY" -m pip download -q --no-deps --no-binary=:all: -d "$tmp/sdist" "$DEEPSPEED"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "$tmp"/sdist/deepspeed-*.tar.gz

# bitsandbytes ships one library per CUDA/ROCm/XPU version (43 MB); torch 2.11+cu130 loads libbitsandbytes_cuda130
# (cuda132 kept for a newer image, cpu for the CPU fallback). Rewrite the wheel without the others.
"$PY" - "$DEST" <<'EOF'
import sys, zipfile
from pathlib import Path

KEEP = ("libbitsandbytes_cpu.so", "libbitsandbytes_cuda130.so", "libbitsandbytes_cuda132.so")
(wheel,) = Path(sys.argv[1]).glob("bitsandbytes-*.whl")
slim = wheel.with_suffix(".slim")


def dropped(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return base.startswith("libbitsandbytes_") and base not in KEEP


with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
    for info in src.infolist():
        if dropped(info.filename):
            continue
        data = src.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(keepends=True)
            data = "".join(line for line in lines if not dropped(line.split(",", 1)[0])).encode()
        dst.writestr(info, data)
slim.replace(wheel)
EOF

if ! git -C "$ROOT" check-ignore -q .whl/x.whl; then
    echo "warning: .whl/ is not ignored by git (the repository's .gitignore lists /.whl/); never commit it" >&2
fi
# What travels: tracked files and untracked files git does not ignore (the wheels are carried on top).
tree=$(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb | tail -1 | cut -f1)
wheels=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
ls -l "$DEST"
echo "wheels: $wheels bytes; working tree that travels: $tree bytes; together $((tree + wheels)) of $LIMIT"
if (( tree + wheels > LIMIT )); then
    echo "error: the wheels and the working tree exceed the 64 MiB that travels" >&2
    exit 1
fi
