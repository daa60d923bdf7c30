"""sglang's DeepEP MoE layers on a moe-dispatch backend (``pip install moe-dispatch-sglang``).

::

    MOE_DISPATCH_SGLANG_BACKEND=torch python -m sglang.launch_server ... --moe-a2a-backend deepep \\
        --deepep-mode low_latency

sglang loads this plugin in every process (entry point ``sglang.srt.plugins``). Without
``MOE_DISPATCH_SGLANG_BACKEND`` it does nothing. With it, it replaces sglang's ``DeepEPDispatcher`` by
``MoEDispatchDeepEPDispatcher``, so that everything sglang does for a DeepEP-class backend stays (the
``DeepEPMoE`` layers, the models' ``forward_deepep``, two-batch overlap, the expert-distribution recorder) and
the tokens travel through the named moe-dispatch backend. Checked against sglang 0.5.23.
"""

from __future__ import annotations

import os

#: The setting that switches the plugin on: a moe-dispatch backend's name (``moe-dispatch backends``).
BACKEND_VARIABLE = "MOE_DISPATCH_SGLANG_BACKEND"
#: What the plugin replaces (sglang 0.5.23 layers/moe/token_dispatcher/deepep.py:983); sglang's hook registry
#: re-points the names other modules imported (``MaybeTboDeepEPDispatcher``'s).
HOOK_TARGET = "sglang.srt.layers.moe.token_dispatcher.deepep.DeepEPDispatcher"

__all__ = ["BACKEND_VARIABLE", "HOOK_TARGET", "register"]


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: with ``MOE_DISPATCH_SGLANG_BACKEND`` set, hook the dispatcher."""
    backend = os.environ.get(BACKEND_VARIABLE, "")
    if not backend:
        return
    from ._dispatcher import MoEDispatchDeepEPDispatcher
    from ._sglang import HookRegistry, HookType

    # Said at the first dispatcher, not here: sglang sets up its logging after loading its plugins.
    HookRegistry.register(HOOK_TARGET, MoEDispatchDeepEPDispatcher, HookType.REPLACE)
