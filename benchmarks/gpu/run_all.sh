#!/usr/bin/env bash
# shared/GPU.md's checklist in one command, on one H100/H200, inside a 10-minute device call:
#
#     bash benchmarks/gpu/run_all.sh OUT_DIR [VENDOR_SRC] [SECONDS] [STEP...]
#
# STEPs (default all): core kit profile hbm bench dgprobe deepep. deepep builds the vendors first; dgprobe runs
# benchmarks/gpu/dg_probe.py's stages 0-4, each in a fresh process (where DeepGEMM's first GEMM dies); build only
# builds and installs them and copies the wheels to OUT_DIR (for a later call to carry); gdb (not in
# the default) runs the vendor check under cuda-gdb with DeepGEMM's JIT log on, for the native stack
# of a crash in the vendor's code (2026-11-23: a segfault in DeepGEMM's contiguous GEMM).
#
# VENDOR_SRC (default .hw-src) holds source trees of deepseek-ai/DeepEP (2.x, and DeepEP-v1: the last
# V1-only commit), deepseek-ai/DeepGEMM with their submodules' headers, and NVIDIA/nccl 2.30.7, made
# from the local mirrors by benchmarks/gpu/vendor_src.sh; the 2.x wheel is installed if it builds, else
# V1's. DeepEP 2.x needs NCCL >= 2.30.4 and the image has 2.28.9: NCCL is built first for the device's
# arch only, DeepEP 2.x against it (EP_NCCL_ROOT_DIR), and the deepep step preloads it (LD_PRELOAD), so
# torch and DeepEP load the one libnccl DeepEP's import check (deep_ep/__init__.py check_nccl_so) wants. The machine's
# torch is never replaced: the project and the vendor wheels go to a --target folder on PYTHONPATH.
# The vendor builds run in the background (niced) while the core checks, which need no vendor, run;
# every step is bounded by what is left of SECONDS (default 560). Output: OUT_DIR/{setup.log,
# core.txt,core.json,kit.txt,profile.txt,deepep.txt (dgprobe's too),bench.txt,bench.json,gdb.txt} (the device tool
# returns at most 8 files: name fewer steps, or leave bench out, with gdb).
set -u
out=${1:?usage: run_all.sh OUT_DIR [VENDOR_SRC] [SECONDS] [STEP...]}
src=${2:-.hw-src}
budget=${3:-560}
shift $(( $# < 3 ? $# : 3 ))
steps=" ${*:-core kit profile hbm bench dgprobe deepep} "
start=$SECONDS
site=/tmp/moe-dispatch-hw
mkdir -p "$out" "$site"
left() { echo $(( budget - (SECONDS - start) )); }
step() {  # step NAME LOG COMMAND...: run under what is left, log the status
  local name=$1 log=$2; shift 2
  [[ $steps == *" $name "* ]] || return 0
  local t=$(left)
  if (( t < 20 )); then echo "== $name: skipped, ${t}s left" >>"$out/setup.log"; return; fi
  echo "== $name (${t}s left): $*" >>"$out/setup.log"
  timeout --signal=INT --kill-after=10 "$t" "$@" >>"$log" 2>&1
  echo "== $name: exit $? after $(( SECONDS - start ))s" >>"$out/setup.log"
}

{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvcc --version | tail -2
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(),
    "nccl", torch.cuda.nccl.version())'
  python3 -m pip list 2>/dev/null | grep -iE '^(nvidia-nccl|nvidia-nvshmem|triton|setuptools|wheel)'
  python3 -m pip install -q --no-deps --no-build-isolation --target "$site" ./core ./plugins/cuda_deepep \
    ./plugins/flashinfer_cutedsl
} >"$out/setup.log" 2>&1
export PYTHONPATH=$site PYTHONUNBUFFERED=1

# The vendor builds, niced, beside the checks that do not need them.
wheels=/tmp/moe-dispatch-wheels
mkdir -p "$wheels"
build() {  # build NAME: a wheel from $src/NAME into $wheels/NAME; its log is appended to setup.log at the end
  mkdir -p "$wheels/$1"
  # CPATH: CUDA 13 keeps libcu++ (cuda/std/...) under include/cccl, which NVSHMEM 3.4's headers need and only
  # DeepEP 2.x's setup.py adds.
  (cd "$src/$1" && MAX_JOBS=8 DG_USE_LOCAL_VERSION=1 CPATH=/usr/local/cuda/include/cccl${CPATH:+:$CPATH} nice -n 19 \
    timeout "$(left)" python3 -m pip wheel -q --no-deps --no-build-isolation -w "$wheels/$1" .) \
    >"/tmp/build-$1.log" 2>&1
  echo "== build $1: exit $?" >"/tmp/build-$1.status"
}
nccl=/tmp/nccl-build
nccl_then_deepep() {  # NCCL for this GPU's arch (make src.build), then DeepEP 2.x against it
  local arch
  arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
  (cd "$src/nccl" && nice -n 19 timeout "$(left)" make -j16 src.build BUILDDIR="$nccl" CUDA_HOME=/usr/local/cuda \
    NVCC_GENCODE="-gencode=arch=compute_$arch,code=sm_$arch") >/tmp/build-nccl.log 2>&1
  echo "== build nccl (sm_$arch): exit $?" >/tmp/build-nccl.status
  ls "$nccl"/lib/libnccl.so.2* >/dev/null 2>&1 && export EP_NCCL_ROOT_DIR=$nccl
  build DeepEP
}
if [[ $steps == *" deepep "* || $steps == *" build "* || $steps == *" gdb "* || $steps == *" dgprobe "* ]]; then
  for name in DeepGEMM DeepEP-v1; do
    [[ -d "$src/$name" ]] && build "$name" &
  done
  if [[ -d "$src/DeepEP" && -d "$src/nccl" ]]; then nccl_then_deepep &
  elif [[ -d "$src/DeepEP" ]]; then build DeepEP &
  fi
fi

# 1-2. codecs, reference layers, low-latency mode in a CUDA graph, no host sync.
step core "$out/core.txt" python3 benchmarks/gpu/check_core.py --json "$out/core.json"
# 1. the kit's whole-layer case on device="cuda".
step kit "$out/kit.txt" torchrun --nproc-per-node 1 --master-addr 127.0.0.1 --master-port 29517 \
  -m moe_dispatch.testing.torchrun --backend torch --device cuda
# 3. where a dispatch + combine spends its time (torch's profiler).
step profile "$out/profile.txt" python3 benchmarks/gpu/profile_layer.py
# 3. HBM: a device-to-device copy, the figure the bench's bandwidth is read against.
step hbm "$out/bench.txt" python3 - <<'EOF'
import torch
x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
a.record()
for _ in range(10): y.copy_(x)
b.record(); torch.cuda.synchronize()
s = a.elapsed_time(b) / 10 / 1e3
print(f"device-to-device copy of 2 GiB: {s * 1e3:.3f} ms, {2 * x.numel() / s / 1e12:.2f} TB/s read+write")
EOF
wait
for f in /tmp/build-*.status; do  # each failed build's first errors
  cat "$f"
  grep -q "exit 0" "$f" || grep -m 12 -E "error" "${f%.status}.log" | cut -c1-300
done >>"$out/setup.log" 2>&1
ls -la "$wheels"/* >>"$out/setup.log" 2>&1
deep_ep=$(ls "$wheels"/DeepEP/*.whl 2>/dev/null || ls "$wheels"/DeepEP-v1/*.whl 2>/dev/null)
for whl in "$wheels"/DeepGEMM/*.whl $deep_ep; do
  [[ -f "$whl" ]] && echo "== install $whl" >>"$out/setup.log" && \
    python3 -m pip install -q --no-deps --target "$site" "$whl" >>"$out/setup.log" 2>&1
  [[ -f "$whl" && $steps == *" build "* ]] && cp "$whl" "$out/"
done
# 3. the bench tables at one rank, once the builds are done (no CPU contention).
step bench "$out/bench.txt" torchrun --nproc-per-node 1 --master-addr 127.0.0.1 --master-port 29518 \
  benchmarks/gpu/bench_torchrun.py --tokens 128 --tokens 4096 --iters 30 --warmup 5 --json "$out/bench.json"
# 4-5. DeepGEMM and DeepEP for real, against the fakes; with the built NCCL preloaded where DeepEP 2.x was built
# against it (one libnccl in the process, torch's and DeepEP's alike).
nccl_env=()
if [[ -n $(ls "$wheels"/DeepEP/*.whl 2>/dev/null) && -n $(ls "$nccl"/lib/libnccl.so.2 2>/dev/null) ]]; then
  nccl_env=(LD_PRELOAD="$nccl/lib/libnccl.so.2" EP_NCCL_ROOT_DIR="$nccl")
fi
echo "== vendor env: ${nccl_env[*]:-none, the NCCL of the image}" >>"$out/setup.log"
# DeepGEMM stage by stage, each in its own process, line-buffered so a crash keeps the JIT's log (exit 139: SIGSEGV).
step dgprobe "$out/deepep.txt" bash -c 'for s in 0 1 2 3 4; do
  DG_JIT_DEBUG=1 stdbuf -oL -eL timeout 150 python3 -X faulthandler benchmarks/gpu/dg_probe.py $s --tests "$1/DeepGEMM/tests"
  echo "== stage $s: exit $?"; done' dgprobe "$src"
step deepep "$out/deepep.txt" env "${nccl_env[@]}" python3 -X faulthandler plugins/cuda_deepep/scripts/hardware_check.py
debugger=$(command -v cuda-gdb || command -v gdb || echo gdb-not-found)
step gdb "$out/gdb.txt" env "${nccl_env[@]}" DG_JIT_DEBUG=1 stdbuf -oL -eL "$debugger" -q -batch -ex run -ex bt \
  --args python3 -X faulthandler plugins/cuda_deepep/scripts/hardware_check.py
echo "== done after $(( SECONDS - start ))s" >>"$out/setup.log"
