#!/usr/bin/env bash
# shared/GPU.md's checklist in one command, on one H100/H200, inside a 10-minute device call:
#
#     bash benchmarks/gpu/run_all.sh OUT_DIR [VENDOR_SRC] [SECONDS] [STEP...]
#
# STEPs (default all, in this order): core kit profile hbm dgprobe deepep deepgemm bench. The vendor steps build the
# vendors first, in the background while the core steps run: NCCL then DeepEP 2.x (V1 only if that fails) for deepep,
# DeepGEMM for dgprobe. dgprobe runs benchmarks/gpu/dg_probe.py's stages 0-5 (where DeepGEMM's first GEMM dies) in
# fresh processes: with NVCC and with NVRTC (DG_JIT_USE_NVRTC=1), each with an empty kernel cache and again warm;
# deepep runs the vendor check without DeepGEMM (so that its crash cannot hide the DeepEP rows), deepgemm the same
# check with it; bench comes last. build only builds and installs them and copies the wheels to OUT_DIR; gdb (not in
# the default) runs the dg_probe stage that died (dgprobe's "first death", else stage 2: the runner's first call) under
# cuda-gdb (gdb where there is none) with DeepGEMM's JIT log on, for the native stack of a crash in the vendor's code
# (2026-11-23: a segfault in DeepGEMM's contiguous GEMM); engines (not in the default either) runs the engine adapters
# through sglang's and vLLM's GPU expert paths. CUDA_HOME is set explicitly (below) for the builds and DeepGEMM's JIT.
# A second call while the machine is still warm keeps the wheels and the NCCL build of the first.
#
# VENDOR_SRC (default .hw-src) holds source trees of deepseek-ai/DeepEP (2.x, and DeepEP-v1: the last
# V1-only commit), deepseek-ai/DeepGEMM with their submodules' headers, and NVIDIA/nccl 2.30.7, made
# from the local mirrors by benchmarks/gpu/vendor_src.sh; the 2.x wheel is installed if it builds, else
# V1's. DeepEP 2.x needs NCCL >= 2.30.4 and the image has 2.28.9: NCCL is built first for the device's
# arch only (SendRecv kernels only: one GPU), DeepEP 2.x against it (EP_NCCL_ROOT_DIR), and the vendor steps preload
# it (LD_PRELOAD), so torch and DeepEP load the one libnccl DeepEP's import check (deep_ep/__init__.py check_nccl_so)
# wants. The machine's torch is never replaced: the project and the vendor wheels go to a --target folder on PYTHONPATH.
# The vendor builds run in the background (niced) while the core checks, which need no vendor, run;
# every step is bounded by what is left of SECONDS (default 560). Output: OUT_DIR/{setup.log,
# core.txt,core.json,kit.txt,profile.txt,deepep.txt (dgprobe's and deepgemm's too),bench.txt,bench.json,gdb.txt} (the
# device tool returns at most 8 files: name fewer steps, or leave bench out, with gdb).
set -u
out=${1:?usage: run_all.sh OUT_DIR [VENDOR_SRC] [SECONDS] [STEP...]}
src=${2:-.hw-src}
budget=${3:-560}
shift $(( $# < 3 ? $# : 3 ))
steps=" ${*:-core kit profile hbm dgprobe deepep deepgemm bench} "
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
    "nccl (compiled against)", torch.cuda.nccl.version())'
  python3 -m pip list 2>/dev/null | grep -iE '^(nvidia-nccl|nvidia-nvshmem|triton|setuptools|wheel)'
  # --upgrade: on a machine still warm from a call before, --target keeps what is there (pip's _handle_target_dir)
  python3 -m pip install -q --upgrade --no-deps --no-build-isolation --target "$site" ./core ./testing ./plugins/cuda_deepep \
    ./plugins/cuda_deepep/testing ./plugins/flashinfer_cutedsl ./plugins/flashinfer_cutedsl/testing
} >"$out/setup.log" 2>&1
export PYTHONPATH=$site PYTHONUNBUFFERED=1
# DeepGEMM's JIT takes its CUDA root from CUDA_HOME, else from `which nvcc`'s grandparent (deepseek-ai/DeepGEMM@54e2261
# deep_gemm/__init__.py:104-125; vendor.py DG_CUDA_HOME_VARIABLES): /usr/local for a wrapper or link in /usr/local/bin,
# where NVRTC finds no include/ (csrc/jit/compiler.hpp:266). So it is set here: the real nvcc's root (links resolved),
# else /usr/local/cuda, the first with bin/nvcc and include/cuda.h (vendor.dg_cuda_home, which dg_probe.py uses).
if [[ -z ${CUDA_HOME:-} ]]; then
  nvcc_real=$(readlink -f "$(command -v nvcc)" 2>/dev/null)
  for root in "$(dirname "$(dirname "${nvcc_real:-/nonexistent/bin/nvcc}")")" /usr/local/cuda; do
    if [[ -x $root/bin/nvcc && -e $root/include/cuda.h ]]; then export CUDA_HOME=$root; break; fi
  done
fi
echo "CUDA_HOME=${CUDA_HOME:-unset} (nvcc: $(command -v nvcc) -> $(readlink -f "$(command -v nvcc)" 2>/dev/null))" \
  >>"$out/setup.log"

# The vendor builds, niced, beside the checks that do not need them. The critical path is NCCL then DeepEP 2.x;
# DeepEP V1 builds only if 2.x does not (2.x carries V1's Buffer as deep_ep.Buffer anyway). A wheel already built on
# this machine (a call before, while it stayed warm) is kept.
wheels=/tmp/moe-dispatch-wheels
mkdir -p "$wheels"
rm -f /tmp/build-*.status
build() {  # build NAME: a wheel from $src/NAME into $wheels/NAME; its log is appended to setup.log at the end
  mkdir -p "$wheels/$1"
  if ls "$wheels/$1"/*.whl >/dev/null 2>&1; then echo "== build $1: kept $(ls "$wheels/$1")" >"/tmp/build-$1.status"; return 0; fi
  local t; t=$(left)
  # timeout 0 means no limit: never start a build that cannot finish
  if (( t < 120 )); then echo "== build $1: skipped, ${t}s left" >"/tmp/build-$1.status"; return 1; fi
  # CPATH: CUDA 13 keeps libcu++ (cuda/std/...) under include/cccl, which NVSHMEM 3.4's headers need and only
  # DeepEP 2.x's setup.py adds. TORCH_CUDA_ARCH_LIST: both DeepEP setup.py files default to 9.0; a multi-arch list
  # from the image would double every compile.
  (cd "$src/$1" && MAX_JOBS=8 TORCH_CUDA_ARCH_LIST=9.0 DG_USE_LOCAL_VERSION=1 \
    CPATH=/usr/local/cuda/include/cccl${CPATH:+:$CPATH} nice -n 19 \
    timeout -k 10 "$t" python3 -m pip wheel -q --no-deps --no-build-isolation -w "$wheels/$1" .) \
    >"/tmp/build-$1.log" 2>&1
  local rc=$?
  echo "== build $1: exit $rc" >"/tmp/build-$1.status"
  return $rc
}
nccl=/tmp/nccl-build
nccl_then_deepep() {  # NCCL for this GPU's arch, then DeepEP 2.x against it; DeepEP V1 if either fails
  local arch t
  arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
  [[ $arch =~ ^[0-9]+$ ]] || arch=90
  if [[ ! -e $nccl/lib/libnccl.so.2 ]]; then
    t=$(left)
    chmod +x "$src"/nccl/src/device/generate.py "$src"/nccl/src/device/symmetric/generate.py \
      "$src"/nccl/src/misc/generate_git_version.py 2>/dev/null
    # One GPU: NCCL runs every collective through ncclLaunchOneRank (NVIDIA/nccl@v2.30.7-1 src/enqueue.cc:3039-3041),
    # so only SendRecv's generated kernels are built (ONLY_FUNCS, src/device/generate.py:34-64: ~1/3 of the compile;
    # the others become no-ops, wrong past one rank), and src.lib skips the static library and the binaries.
    (cd "$src/nccl" && nice -n 19 timeout -k 10 "$t" make -j16 src.lib BUILDDIR="$nccl" CUDA_HOME=/usr/local/cuda \
      NVCC_GENCODE="-gencode=arch=compute_$arch,code=sm_$arch" ONLY_FUNCS="SendRecv" \
      NCCL_GIT_COMMIT_HASH=v2.30.7-1) >/tmp/build-nccl.log 2>&1
    echo "== build nccl (sm_$arch, SendRecv kernels only): exit $?" >/tmp/build-nccl.status
  fi
  # The image's NCCL 2.28.9 cannot build DeepEP 2.x (it needs >= 2.30.4): then V1.
  [[ -e $nccl/lib/libnccl.so.2 ]] || { build DeepEP-v1; return; }
  # LIBRARY_PATH: DeepEP@dd758ca setup.py:121-124 links -l:libnccl.so without -L for NCCL's lib (fixed upstream
  # in 086f58b, not in dd758ca).
  export EP_NCCL_ROOT_DIR=$nccl LIBRARY_PATH=$nccl/lib${LIBRARY_PATH:+:$LIBRARY_PATH}
  build DeepEP || build DeepEP-v1
}
if [[ $steps == *" deepep "* || $steps == *" build "* || $steps == *" gdb "* || $steps == *" dgprobe "* ]]; then
  [[ -d "$src/DeepGEMM" ]] && build DeepGEMM &
fi
if [[ $steps == *" deepep "* || $steps == *" build "* || $steps == *" gdb "* ]]; then
  if [[ -d "$src/DeepEP" && ( -d "$src/nccl" || -e $nccl/lib/libnccl.so.2 ) ]]; then nccl_then_deepep &
  elif [[ -d "$src/DeepEP-v1" ]]; then build DeepEP-v1 &
  fi
fi

# 1-2. codecs, reference layers, low-latency mode in a CUDA graph, no host sync.
step core "$out/core.txt" python3 benchmarks/gpu/check_core.py --json "$out/core.json"
# 1. the kit's whole-layer case on device="cuda".
step kit "$out/kit.txt" torchrun --nproc-per-node 1 --master-addr 127.0.0.1 --master-port 29517 \
  -m moe_dispatch_testing.torchrun --backend torch --device cuda
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
for f in /tmp/build-*.status; do  # each failed build's first errors (make's "Error 126", the linker's "cannot find")
  [[ -e $f ]] || continue
  cat "$f"
  grep -q "exit 0\|kept" "$f" || { grep -m 12 -iE "error|cannot find|denied|undefined|not found" "${f%.status}.log"
    tail -n 4 "${f%.status}.log"; } | cut -c1-300
done >>"$out/setup.log" 2>&1
ls -la "$wheels"/* >>"$out/setup.log" 2>&1
# DeepGEMM in a folder of its own, on PYTHONPATH only where it is wanted: its first GEMM segfaulted on 2026-11-23, and
# the vendor check runs DeepGEMM's section first (without it, vendor.detect_deep_gemm makes a row of the missing module).
dg_site=/tmp/moe-dispatch-dg
deep_ep=$(ls "$wheels"/DeepEP/*.whl 2>/dev/null || ls "$wheels"/DeepEP-v1/*.whl 2>/dev/null)
for whl in "$wheels"/DeepGEMM/*.whl $deep_ep; do
  [[ -f "$whl" ]] || continue
  target=$site; [[ $whl == "$wheels"/DeepGEMM/* ]] && target=$dg_site
  echo "== install $whl into $target" >>"$out/setup.log"
  python3 -m pip install -q --upgrade --no-deps --target "$target" "$whl" >>"$out/setup.log" 2>&1
  [[ $steps == *" build "* ]] && cp "$whl" "$out/"  # DeepEP 2.x's wheel needs $nccl at the same path to load
done
# 4-5. DeepGEMM and DeepEP for real, against the fakes; with the built NCCL preloaded where DeepEP 2.x was built
# against it (one libnccl in the process, torch's and DeepEP's alike: deep_ep/__init__.py check_nccl_so).
nccl_env=()
if [[ -n $(ls "$wheels"/DeepEP/*.whl 2>/dev/null) && -n $(ls "$nccl"/lib/libnccl.so.2 2>/dev/null) ]]; then
  nccl_env=(LD_PRELOAD="$nccl/lib/libnccl.so.2" EP_NCCL_ROOT_DIR="$nccl")
fi
{
  echo "== vendor env: ${nccl_env[*]:-none, the NCCL of the image}"
  env ${nccl_env[@]+"${nccl_env[@]}"} python3 -c 'import ctypes, torch; v = ctypes.c_int()
ctypes.CDLL("libnccl.so.2").ncclGetVersion(ctypes.byref(v))
print("nccl loaded", v.value, sorted({l.split()[-1] for l in open("/proc/self/maps") if "libnccl" in l}))'
} >>"$out/setup.log" 2>&1
# DeepGEMM stage by stage, four times, each in its own process (NVCC and NVRTC, a cold then a warm kernel cache),
# line-buffered with DeepGEMM's JIT log so a crash keeps it (exit -11: SIGSEGV); "== first death: stage N" names where.
step dgprobe "$out/deepep.txt" env PYTHONPATH="$dg_site:$site" python3 benchmarks/gpu/dg_probe.py 5 --variants \
  --timeout 150 --tests "$src/DeepGEMM/tests"
# DeepEP (V1 and 2.x), without DeepGEMM; then the whole check again with it (its runner on the real library).
step deepep "$out/deepep.txt" env ${nccl_env[@]+"${nccl_env[@]}"} python3 -X faulthandler \
  plugins/cuda_deepep/scripts/hardware_check.py
step deepgemm "$out/deepep.txt" env ${nccl_env[@]+"${nccl_env[@]}"} PYTHONPATH="$dg_site:$site" python3 -X faulthandler \
  plugins/cuda_deepep/scripts/hardware_check.py
# The dg_probe stage that died first (with the compiler it died with) under the debugger, else stage 2.
debugger=$(command -v cuda-gdb || command -v gdb || echo gdb-not-found)
death=$(grep -m1 '^== first death: stage' "$out/deepep.txt" 2>/dev/null)
died=$(sed -nE 's/^== first death: stage ([0-9]+).*/\1/p' <<<"$death")
nvrtc=0; [[ $death == *nvrtc* ]] && nvrtc=1
step gdb "$out/gdb.txt" env PYTHONPATH="$dg_site:$site" DG_JIT_DEBUG=1 DG_JIT_USE_NVRTC=$nvrtc stdbuf -oL -eL \
  "$debugger" -q -batch -ex run -ex bt --args python3 -X faulthandler benchmarks/gpu/dg_probe.py "${died:-2}" \
  --tests "$src/DeepGEMM/tests"
# 3. the bench tables at one rank, last: the vendor steps are what the builds were for.
step engines "$out/engines.txt" python3 benchmarks/gpu/engine_adapters.py  # sglang, vLLM where the image has them
step bench "$out/bench.txt" torchrun --nproc-per-node 1 --master-addr 127.0.0.1 --master-port 29518 \
  benchmarks/gpu/bench_torchrun.py --tokens 128 --tokens 4096 --iters 30 --warmup 5 --json "$out/bench.json"
echo "== done after $(( SECONDS - start ))s" >>"$out/setup.log"
