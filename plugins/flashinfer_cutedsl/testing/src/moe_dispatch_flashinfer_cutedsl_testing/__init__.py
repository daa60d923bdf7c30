"""moe-dispatch-flashinfer-cutedsl-testing: the CPU fakes of FlashInfer (``fakes``, one module per version
range where it behaves differently), their module paths, and what the tests share (``support``). Pass a
fake's module path where the plugin takes a vendor module::

    FlashInferA2ABackend(EMULATOR), CuteDslExperts(FAKE_0_6_13)

Importing this package imports no fake.
"""

from __future__ import annotations

from moe_dispatch_flashinfer_cutedsl.vendor import Version

FAKES_PACKAGE = f"{__name__}.fakes"
FAKE_0_6_6 = f"{FAKES_PACKAGE}.flashinfer_0_6_6"
FAKE_0_6_7 = f"{FAKES_PACKAGE}.flashinfer_0_6_7"
FAKE_0_6_13 = f"{FAKES_PACKAGE}.flashinfer_0_6_13"
FAKE_0_6_14 = f"{FAKES_PACKAGE}.flashinfer_0_6_14"
FAKE_0_6_15 = f"{FAKES_PACKAGE}.flashinfer_0_6_15"
FAKE_0_6_17 = f"{FAKES_PACKAGE}.flashinfer_0_6_17"
FAKE_0_7_0 = f"{FAKES_PACKAGE}.flashinfer_0_7_0"
FAKE_0_7_1 = f"{FAKES_PACKAGE}.flashinfer_0_7_1"
FAKE_0_7_2 = f"{FAKES_PACKAGE}.flashinfer_0_7_2"
FAKE_0_7_4 = f"{FAKES_PACKAGE}.flashinfer_0_7_4"
#: FlashInfer's own Python (MoeAlltoAll, MnnvlMemory's communicator logic, Mapping) with only the
#: compiled module and the CUDA-driver memory replaced by the fakes: the optional vendor-code tests.
REAL_PYTHON_ON_FAKE_KERNELS = f"{FAKES_PACKAGE}.real_python"
#: The fake of the newest FlashInfer this plugin was checked against.
EMULATOR = FAKE_0_7_4
#: Each fake and the release it models, oldest first.
FAKES: tuple[tuple[str, Version], ...] = (
    (FAKE_0_6_6, (0, 6, 6)), (FAKE_0_6_7, (0, 6, 7)), (FAKE_0_6_13, (0, 6, 13)), (FAKE_0_6_14, (0, 6, 14)),
    (FAKE_0_6_15, (0, 6, 15)), (FAKE_0_6_17, (0, 6, 17)), (FAKE_0_7_0, (0, 7, 0)), (FAKE_0_7_1, (0, 7, 1)),
    (FAKE_0_7_2, (0, 7, 2)), (FAKE_0_7_4, (0, 7, 4)))
#: The version range each fake stands for (from this version on, until the next).
FAKE_RANGES: tuple[tuple[Version, str], ...] = (
    ((0, 6, 0), FAKE_0_6_6), ((0, 6, 7), FAKE_0_6_7), ((0, 6, 8), FAKE_0_6_13), ((0, 6, 14), FAKE_0_6_14),
    ((0, 6, 15), FAKE_0_6_15), ((0, 6, 16), FAKE_0_6_17), ((0, 6, 18), FAKE_0_7_0), ((0, 7, 1), FAKE_0_7_1),
    ((0, 7, 2), FAKE_0_7_2), ((0, 7, 4), FAKE_0_7_4))


def fake_for(version: Version) -> str:
    """The fake of the version range ``version`` falls in."""
    found = FAKE_RANGES[0][1]
    for since, name in FAKE_RANGES:
        if version >= since:
            found = name
    return found


__all__ = [
    "EMULATOR",
    "FAKES",
    "FAKES_PACKAGE",
    "FAKE_0_6_6",
    "FAKE_0_6_7",
    "FAKE_0_6_13",
    "FAKE_0_6_14",
    "FAKE_0_6_15",
    "FAKE_0_6_17",
    "FAKE_0_7_0",
    "FAKE_0_7_1",
    "FAKE_0_7_2",
    "FAKE_0_7_4",
    "FAKE_RANGES",
    "REAL_PYTHON_ON_FAKE_KERNELS",
    "fake_for",
]
