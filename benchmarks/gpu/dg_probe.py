"""Where DeepGEMM's first contiguous FP8 GEMM dies (the 2026-11-23 H100 run: a segfault inside the runner's first
call; docs/evidence/vendor-notes/deepgemm-segfault-hypotheses.md), stage by stage in one process::

    DG_JIT_DEBUG=1 stdbuf -oL -eL python3 -X faulthandler benchmarks/gpu/dg_probe.py STAGE [--tests DIR]
    python3 benchmarks/gpu/dg_probe.py STAGE --variants     # the same in fresh processes: NVCC, NVRTC; cold, warm
    python3 benchmarks/gpu/dg_probe.py 5 --variants --fake  # the plumbing on CPU, the fake DeepGEMM in its place

0. the environment (``CUDA_HOME`` set explicitly: ``vendor.dg_cuda_home``, the real nvcc's root) and the installed
   package (its include/ headers, the extension's linked libraries);
1. DeepGEMM's device runtime (``get_num_sms``: cuBLASLt and its workspace);
2. the runner's first call (``hardware.deep_gemm_rows(first_only=True)``: block-FP8 PACKED, counts [5, 0, 130, 1]),
   its activation scales laid out by the runner, so that DeepGEMM's first JIT kernel is the GEMM itself; then whether
   DeepGEMM keeps that layout (``hardware.scale_layout_rows``: no transpose kernel);
3. DeepGEMM's own scale-factor transpose (``get_mn_major_tma_aligned_tensor`` on row-major scales: its
   ``transpose_fp32`` JIT kernel, the runner's first kernel before it laid the scales out itself);
4. a contiguous FP8 GEMM with DeepGEMM's own test inputs (``--tests``: DeepGEMM's tests/ folder);
5. the runner's rows of ``hardware_check.py`` (``hardware.deep_gemm_rows``), in a process without a process group.

``--variants`` runs stages 0..STAGE four times, each in a fresh process under ``--timeout``: NVCC then NVRTC
(``DG_JIT_USE_NVRTC=1``), each with an empty kernel cache (``DG_JIT_CACHE_DIR``) and again with it warm, and names the
first stage that died (``== first death: stage N``; run_all.sh's gdb step runs that stage under the debugger). A stage
that passes prints ``== N ... ok``; the last ``==`` line and DeepGEMM's last debug line bracket a crash.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys

LAST_STAGE = 5


def say(text: str) -> None:
    print(f"== {text}", flush=True)


def variants(stage: int, tests: str, timeout_s: int, fake: bool) -> int:
    """Stages 0..``stage`` in fresh processes: NVCC and NVRTC, each cold (an emptied cache) then warm."""
    from moe_dispatch_cuda_deepep import vendor

    first_death = None
    for compiler in ("nvcc", "nvrtc"):
        cache = f"/tmp/dg-probe-cache-{compiler}"
        shutil.rmtree(cache, ignore_errors=True)
        env = {**os.environ, vendor.DG_JIT_CACHE_DIR: cache, vendor.DG_JIT_DEBUG: "1"}
        env[vendor.DG_JIT_USE_NVRTC] = "1" if compiler == "nvrtc" else "0"
        for cache_state in ("cold", "warm"):
            say(f"run {compiler} {cache_state}: {vendor.DG_JIT_USE_NVRTC}={env[vendor.DG_JIT_USE_NVRTC]} "
                f"{vendor.DG_JIT_CACHE_DIR}={cache}")
            command = ["stdbuf", "-oL", "-eL", sys.executable, "-X", "faulthandler", __file__, str(stage),
                       "--tests", tests, *(["--fake"] if fake else [])]
            try:
                done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      timeout=timeout_s, check=False)
                out, code = done.stdout, done.returncode
            except subprocess.TimeoutExpired as exc:
                out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
                code = f"timed out after {timeout_s} s"
            print(out, end="" if out.endswith("\n") else "\n", flush=True)
            passed = [int(n) for n in re.findall(r"^== (\d) .* ok$", out, re.MULTILINE)]
            died = None if passed and max(passed) == stage else (max(passed) + 1 if passed else 0)
            say(f"run {compiler} {cache_state}: exit {code}" + ("" if died is None else f", died in stage {died}"))
            if died is not None and first_death is None:
                first_death = f"stage {died} ({compiler} {cache_state})"
    if first_death is not None:
        say(f"first death: {first_death}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stage", type=int, choices=range(LAST_STAGE + 1), help="run stages 0..STAGE")
    p.add_argument("--tests", default=".hw-src/DeepGEMM/tests", help="DeepGEMM's tests/ folder (stage 4)")
    p.add_argument("--variants", action="store_true", help="in fresh processes: NVCC, NVRTC; cold, warm cache")
    p.add_argument("--timeout", type=int, default=150, help="seconds per process with --variants")
    p.add_argument("--fake", action="store_true", help="the fake DeepGEMM on CPU (the script's plumbing, no GPU)")
    args = p.parse_args(argv)
    if args.variants:
        return variants(args.stage, args.tests, args.timeout, args.fake)
    import importlib

    import torch

    from moe_dispatch_cuda_deepep import vendor
    from moe_dispatch_cuda_deepep_testing import DEEP_GEMM_EMULATOR, hardware

    # DeepGEMM reads its CUDA root once, at import (deep_gemm/__init__.py:104-125): set it before, explicitly.
    given = next((os.environ[name] for name in vendor.DG_CUDA_HOME_VARIABLES if os.environ.get(name)), None)
    home = given or vendor.dg_cuda_home()
    if home:
        os.environ[vendor.DG_CUDA_HOME_VARIABLES[0]] = home
    nvcc = shutil.which("nvcc")
    say(f"HOME={os.environ.get('HOME')} CUDA_HOME={home} ({'given' if given else 'derived: vendor.dg_cuda_home'}) nvcc={nvcc} -> "
        f"{nvcc and os.path.realpath(nvcc)} "
        + " ".join(f"{name}={os.environ.get(name)}" for name in (vendor.DG_JIT_USE_NVRTC, vendor.DG_JIT_CACHE_DIR))
        + f" stack={resource.getrlimit(resource.RLIMIT_STACK)} torch={torch.__version__}")
    deep_gemm = importlib.import_module(DEEP_GEMM_EMULATOR if args.fake else vendor.DEEP_GEMM)
    device = torch.device("cpu" if args.fake else "cuda")
    if args.fake:
        from moe_dispatch_testing.local import one_rank_group

        one_rank_group("gloo")
    setup = hardware.fake_setup() if args.fake else hardware.Setup("deep_ep", "deep_gemm", device, None, None, False)
    root = os.path.dirname(deep_gemm.__file__)
    headers = sum(len(files) for _, _, files in os.walk(os.path.join(root, "include")))
    say(f"0 deep_gemm {getattr(deep_gemm, '__version__', '?')} at {root}: {headers} headers ok")
    for name in os.listdir(root):
        if name.startswith("_C") and name.endswith(".so"):
            print(subprocess.run(["ldd", os.path.join(root, name)], capture_output=True, text=True, check=False).stdout,
                  flush=True)
    if args.stage >= 1:
        sms = "the fake has no device runtime" if args.fake else f"{deep_gemm.get_num_sms()} SMs"
        say(f"1 device runtime: {sms} ok")
    if args.stage >= 2:
        rows = hardware.deep_gemm_rows(setup, first_only=True) + hardware.scale_layout_rows(setup)
        for row in rows:
            print(row.line(), flush=True)
        say(f"2 the runner's first call, scales laid out by the runner: {sum(r.ok for r in rows)} of {len(rows)} "
            "rows agree ok")
    if args.stage >= 3:
        sf = torch.rand(512, 16, device=device)
        laid = getattr(deep_gemm, vendor.DG_MN_MAJOR_TMA_ALIGNED)(sf)
        if not args.fake:
            torch.cuda.synchronize()
        say(f"3 DeepGEMM's transpose JIT: strides {laid.stride()}, equal {torch.equal(laid, sf)} ok")
    if args.stage >= 4 and args.fake:
        say("4 DeepGEMM's own contiguous GEMM: its tests need the real DeepGEMM on a GPU, not run on the fake ok")
    elif args.stage >= 4:
        sys.path.insert(0, args.tests)
        from generators import MajorTypeAB, generate_m_grouped_contiguous  # DeepGEMM's tests/generators.py

        m, a, b, layout, d, ref = generate_m_grouped_contiguous(4, 128, 512, 2048, MajorTypeAB.KMajor,
                                                                 MajorTypeAB.KMajor)
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, d, layout, disable_ue8m0_cast=True)
        torch.cuda.synchronize()
        err = float((d.float() - ref.float()).norm() / ref.float().norm())
        say(f"4 DeepGEMM's own contiguous GEMM: m={m}, relative error {err:.2e} ok")
    if args.stage >= 5:
        for row in hardware.deep_gemm_rows(setup):
            print(row.line(), flush=True)
        say("5 the runner's rows ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
