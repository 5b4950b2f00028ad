#!/usr/bin/env bash
# Instruction counts of the kernels in a CUDA binary whose (mangled) name contains PATTERN:
# all instructions, HMMA / HGMMA (tensor-core MMAs) and HMUL2, per kernel. Runs cuobjdump,
# so on a machine with the CUDA toolkit's binaries (the device).
#   bash scripts/probes/sass_counts.sh .devbuild/moe_ep_gemm_check mxfp8_weights_gemm_kernel
set -euo pipefail
bin="${1:?binary}" pattern="${2:?kernel name pattern}"
cuobjdump --dump-sass "$bin" | awk -v pat="$pattern" '
  /Function :/ { f = $3; keep = index(f, pat) > 0 }
  keep && /^ +\/\*[0-9a-f]+\*\// {
    n[f]++
    if ($0 ~ /HMMA|HGMMA/) mma[f]++
    if ($0 ~ /HMUL2/) mul[f]++
  }
  END { for (k in n) printf "%d instructions, %d MMA, %d HMUL2: %s\n", n[k], mma[k], mul[k], substr(k, 1, 150) }'
