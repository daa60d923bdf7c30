"""Where DeepGEMM's first contiguous FP8 GEMM dies (the 2026-11-23 H100 run: a segfault inside the runner's first
call; docs/evidence/vendor-notes/deepgemm-segfault-hypotheses.md), one stage further per run, each in a process of its own::

    DG_JIT_DEBUG=1 stdbuf -oL -eL python3 -X faulthandler benchmarks/gpu/dg_probe.py STAGE [--tests DIR]

0. the environment and the installed package (its include/ headers, the extension's linked libraries);
1. DeepGEMM's device runtime (``get_num_sms``: cuBLASLt and its workspace);
2. its first JIT kernel on our path: the scale-factor transpose (``get_mn_major_tma_aligned_tensor``);
3. a contiguous FP8 GEMM with DeepGEMM's own test inputs (``--tests``: DeepGEMM's tests/ folder);
4. the runner's rows of ``hardware_check.py`` (``hardware.deep_gemm_rows``), in a process without a process group.

A stage that passes prints ``== N ... ok``; the last ``==`` line and DeepGEMM's last debug line bracket a crash.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys


def say(text: str) -> None:
    print(f"== {text}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stage", type=int, choices=range(5), help="run stages 0..STAGE")
    p.add_argument("--tests", default=".hw-src/DeepGEMM/tests", help="DeepGEMM's tests/ folder (stage 3)")
    args = p.parse_args(argv)
    import torch

    say(f"HOME={os.environ.get('HOME')} CUDA_HOME={os.environ.get('CUDA_HOME')} nvcc={shutil.which('nvcc')} "
        f"stack={resource.getrlimit(resource.RLIMIT_STACK)} torch={torch.__version__}")
    import deep_gemm

    root = os.path.dirname(deep_gemm.__file__)
    headers = sum(len(files) for _, _, files in os.walk(os.path.join(root, "include")))
    say(f"0 deep_gemm {getattr(deep_gemm, '__version__', '?')} at {root}: {headers} headers ok")
    for name in os.listdir(root):
        if name.startswith("_C") and name.endswith(".so"):
            print(subprocess.run(["ldd", os.path.join(root, name)], capture_output=True, text=True).stdout, flush=True)
    if args.stage >= 1:
        say(f"1 device runtime: {deep_gemm.get_num_sms()} SMs ok")
    if args.stage >= 2:
        sf = torch.rand(512, 16, device="cuda")
        laid = deep_gemm.get_mn_major_tma_aligned_tensor(sf)
        torch.cuda.synchronize()
        say(f"2 transpose JIT: strides {laid.stride()}, equal {torch.equal(laid, sf)} ok")
    if args.stage >= 3:
        sys.path.insert(0, args.tests)
        from generators import MajorTypeAB, generate_m_grouped_contiguous  # DeepGEMM's tests/generators.py

        m, a, b, layout, d, ref = generate_m_grouped_contiguous(4, 128, 512, 2048, MajorTypeAB.KMajor,
                                                                 MajorTypeAB.KMajor)
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, d, layout, disable_ue8m0_cast=True)
        torch.cuda.synchronize()
        err = float((d.float() - ref.float()).norm() / ref.float().norm())
        say(f"3 DeepGEMM's own contiguous GEMM: m={m}, relative error {err:.2e} ok")
    if args.stage >= 4:
        from moe_dispatch_cuda_deepep_testing import hardware

        setup = hardware.Setup("deep_ep", "deep_gemm", torch.device("cuda"), None, None, False)
        for row in hardware.deep_gemm_rows(setup):
            print(row.line(), flush=True)
        say("4 the runner's rows ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
