#!/usr/bin/env bash
# One command for the first GPU (under ~8 minutes on one H100/H200): Triton kernel correctness
# (fp32 and bf16, forward and backward, against the torch paths), kernel benchmarks (attention vs
# SDPA flash and flash-attn if installed; delta rule vs torch and flash-linear-attention if
# installed) and 50 training steps of a ~125M-parameter 3 KDA : 1 MLA model (tokens/s, MFU), all in
# one JSON file. Exits non-zero when a kernel is wrong. See bench/gpu_check.py.
#
#   bash bench/gpu_check.sh [out.json]          # default gpu_check.json
#   bash bench/gpu_check.sh /tmp/c.json --dry-run   # CPU, tiny shapes: checks the driver only
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_check.json}"
shift || true
exec python bench/gpu_check.py --out "$out" "$@"
