"""The backend: what it can do (as data), its buffer sizes, and the dispatcher it creates."""

from __future__ import annotations

import moe_dispatch as md
import moe_dispatch.backend as mdb

from .dispatcher import ExampleDispatcher

B, F8, I8, F4 = md.DispatchDtype.BF16, md.DispatchDtype.FP8, md.DispatchDtype.INT8, md.DispatchDtype.NVFP4

CAPABILITIES = mdb.Capabilities(
    # Normal mode only; low_latency is absent, so the kit skips its tests and says why.
    dtypes={md.Mode.NORMAL: frozenset({B, F8})},
    # A dtype the example cannot send is replaced, with a reason the user sees, or rejected.
    fallbacks={(md.Mode.NORMAL, I8): mdb.Fallback(F8, "the example sends 8-bit activations as FP8")},
    rejections={F4: "the example has no NVFP4 path"},
    default_dtype=F8,
    # The layout dispatch returns per mode: PACKED [rows, H] unless the mode is listed here (MASKED).
    masked_modes=frozenset(),
    devices=frozenset({"cpu", "cuda"}),
    limits={md.Mode.NORMAL: mdb.Limits(max_tokens_per_rank=4096, max_top_k=16)},
)


class ExampleBackend(mdb.Backend):
    name = "example"
    description = "example plugin: all-gather the tokens, each rank keeps the rows of its experts"
    capabilities = CAPABILITIES
    install_hint = "pip install moe-dispatch-example"

    def buffer_size(self, spec: md.DispatchSpec, world_size: int) -> mdb.BufferSize:
        """Dispatch stages T send rows and R·T received rows of (wire payload + k ids + k
        weights); combine sends and receives R·T BF16 partial rows."""
        t, k, h = spec.num_max_dispatch_tokens_per_rank, spec.top_k, spec.hidden_size
        row = spec.wire_format().bytes_per_token + 8 * k
        slots = t * world_size
        return mdb.BufferSize(
            dispatch_bytes=(t + slots) * row,
            combine_bytes=2 * slots * 2 * h,
            notes=("every rank receives every rank's T token slots",),
        )

    def create(self, ctx: mdb.DispatchContext) -> ExampleDispatcher:
        return ExampleDispatcher(ctx)
