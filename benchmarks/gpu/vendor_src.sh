#!/usr/bin/env bash
# The vendor source trees run_all.sh builds, from the workplace's mirrors (the `fetch` tool's
# /work/.mirror/OWNER+NAME/repo), at the commits plugins/cuda_deepep/VENDOR.md cites:
#
#     bash benchmarks/gpu/vendor_src.sh [DEST] [MIRRORS]      # default .hw-src, /work/.mirror
#
# DEST must be ignored by git (.git/info/exclude) so the device tool carries it only when named.
# About 39 MiB: CUTLASS's include/ is most of it; NCCL's source (7 MiB) because DeepEP 2.x needs NCCL >= 2.30.4
# and the device images have 2.28.9, whose 252 MB wheel cannot travel (run_all.sh builds it for the device's arch).
set -euo pipefail
dest=${1:-.hw-src}
m=${2:-/work/.mirror}
deepep=dd758ca deepep_v1=567632d deepgemm=54e2261 nccl=v2.30.7-1
rm -rf "$dest"; mkdir -p "$dest/DeepEP" "$dest/DeepEP-v1" "$dest/DeepGEMM" "$dest/nccl"
# NVIDIA/nccl's release tag (2.30.7): what `make src.build` reads, nothing else.
git --git-dir="$m/NVIDIA+nccl/repo" archive "$nccl" Makefile makefiles src LICENSE.txt | tar -x -C "$dest/nccl"
git --git-dir="$m/deepseek-ai+DeepEP/repo" archive "$deepep" | tar -x -C "$dest/DeepEP"
# The last V1-only commit (1.2.1, before V2 at b306af0): NVSHMEM only, no NCCL device API, so it
# builds where DeepEP 2.x's NCCL (>= 2.30.4) is missing.
git --git-dir="$m/deepseek-ai+DeepEP/repo" archive "$deepep_v1" | tar -x -C "$dest/DeepEP-v1"
git --git-dir="$m/deepseek-ai+DeepGEMM/repo" archive "$deepgemm" | tar -x -C "$dest/DeepGEMM"
rm -rf "$dest/DeepEP/figures" "$dest/DeepEP-v1/figures"
fmt_ep=$(git --git-dir="$m/deepseek-ai+DeepEP/repo" ls-tree "$deepep" third-party/fmt | awk '{print $3}')
fmt_gemm=$(git --git-dir="$m/deepseek-ai+DeepGEMM/repo" ls-tree "$deepgemm" third-party/fmt | awk '{print $3}')
cutlass=$(git --git-dir="$m/deepseek-ai+DeepGEMM/repo" ls-tree "$deepgemm" third-party/cutlass | awk '{print $3}')
for pair in "DeepEP/third-party/fmt fmtlib+fmt $fmt_ep" "DeepGEMM/third-party/fmt fmtlib+fmt $fmt_gemm" \
            "DeepGEMM/third-party/cutlass NVIDIA+cutlass $cutlass"; do
  set -- $pair
  mkdir -p "$dest/$1"
  git --git-dir="$m/$2/repo" archive "$3" include | tar -x -C "$dest/$1"
  echo "$1: $2@$3"
done
du -sh "$dest"
