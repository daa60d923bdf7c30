"""Everything a backend plugin may use: the one module a plugin imports besides ``moe_dispatch``.

A plugin is a module named by an entry point in the ``moe_dispatch.backends`` group; it sets
``MOE_DISPATCH_API = API_VERSION`` and registers through the hooks (``@hookimpl``)::

    Backend            describes itself (name, Capabilities, probe), checks a spec, sizes its buffers
      └ create(DispatchContext) ─► BackendDispatcher: dispatch ─► DispatchOutput, combine ─► bf16 [T, H]
                                   (SplitPhaseBackendDispatcher: *_start ─► Pending; FusedBackendDispatcher)

The rest are the pieces the built-in and vendor backends share: the counted ``Comm`` over a
process group, the wire codecs (bit-exact with the vendors' kernels), group-list and row helpers,
scale layouts, the CUDA stream hand-over of split calls, and the vendor-boundary helpers a
plugin's ``vendor.py`` uses (``VendorSignature``, ``restored_environ``). docs/writing-a-backend.md
walks through a backend; the conformance kit (``moe-dispatch-testing``) tests one.
"""

from ._alignment import align_rows
from ._codecs import (
    FP8_MAX,
    Codec,
    INT8Codec,
    NVFP4Codec,
    Quantized,
    as_bytes,
    e2m1_unpack,
    from_bytes,
    make_codec,
    nvfp4_global_scale,
    pack_ue8m0,
    pow2_ceil,
    ue8m0_value,
    unpack_ue8m0,
)
from ._contract import (
    Backend,
    BackendDispatcher,
    BufferSize,
    Capabilities,
    DispatchContext,
    DtypeDecision,
    EnvRequirement,
    Fallback,
    FusedBackendDispatcher,
    Limits,
    RunnerInfo,
    SplitPhaseBackendDispatcher,
)
from ._distributed.comm import DEFAULT_TIMEOUT_S, Comm, Traffic, check_timeout
from ._environ import restored_environ
from ._experts import dequantize_rows, dequantized_weights, quantize_weights_w8a8, swiglu
from ._hookspecs import API_VERSION, Command, hookimpl
from ._output import (
    align_up,
    group_counts,
    group_list_from_counts,
    group_starts,
    kept_routing,
    row_experts,
    rows_by_expert,
    sum_weighted_rows,
)
from ._scale_layouts import from_mma_view, swizzle_128x4, swizzled_shape, to_mma_view, unswizzle_128x4
from ._signatures import REQUIRED, Param, VendorSignature
from ._streams import StartMark, hand_over, handed_over, keep_on_current, start_mark
from ._wire import WireFormat, wire_dtype

__all__ = [
    "API_VERSION",
    "DEFAULT_TIMEOUT_S",
    "FP8_MAX",
    "REQUIRED",
    "Backend",
    "BackendDispatcher",
    "BufferSize",
    "Capabilities",
    "Codec",
    "Comm",
    "Command",
    "DispatchContext",
    "DtypeDecision",
    "EnvRequirement",
    "Fallback",
    "FusedBackendDispatcher",
    "INT8Codec",
    "Limits",
    "NVFP4Codec",
    "Param",
    "Quantized",
    "RunnerInfo",
    "SplitPhaseBackendDispatcher",
    "StartMark",
    "Traffic",
    "VendorSignature",
    "WireFormat",
    "align_rows",
    "align_up",
    "as_bytes",
    "check_timeout",
    "dequantize_rows",
    "dequantized_weights",
    "e2m1_unpack",
    "from_bytes",
    "from_mma_view",
    "group_counts",
    "group_list_from_counts",
    "group_starts",
    "hand_over",
    "handed_over",
    "hookimpl",
    "keep_on_current",
    "kept_routing",
    "make_codec",
    "nvfp4_global_scale",
    "pack_ue8m0",
    "pow2_ceil",
    "quantize_weights_w8a8",
    "restored_environ",
    "row_experts",
    "rows_by_expert",
    "start_mark",
    "sum_weighted_rows",
    "swiglu",
    "swizzle_128x4",
    "swizzled_shape",
    "to_mma_view",
    "ue8m0_value",
    "unswizzle_128x4",
    "unpack_ue8m0",
    "wire_dtype",
]
