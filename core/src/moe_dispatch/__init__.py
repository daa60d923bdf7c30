"""moe-dispatch: token dispatch and combine for expert-parallel MoE inference.

What an engine imports. One layer's forward over the expert-parallel group::

    create_dispatcher(backend, DispatchSpec)      resolve the wire dtype (Resolution), plan buffers, agree
        │
    dispatch(x, topk_ids, topk_weights) ──► DispatchOutput: rows per (token, local expert), unweighted
        │
    run_experts(experts, layer, out)      ──► ExpertKernel.apply_without_routing_weights: rows in place
        │
    combine(expert_rows, out)           ──► bf16 [T, H]: the weighted sum of each token's experts

``Dispatcher.forward`` runs the three; ``dispatch_start``/``combine_start`` split each call in two (``Pending``) for
micro-batch overlap. Backend authors import ``moe_dispatch.backend``; buffer planning is ``moe_dispatch.planning``.
"""

from ._torch_import import import_torch

import_torch()  # before anything imports torch: torch-npu without CANN must not break the import

from typing import TYPE_CHECKING, Any  # noqa: E402

from ._errors import (  # noqa: E402
    BackendUnavailableError,
    CallOrderError,
    CapacityError,
    CollectiveTimeoutError,
    CommunicationError,
    ConfigMismatchError,
    InvalidInputError,
    InvalidSpecError,
    MoEDispatchError,
    PeerFailedError,
    PluginError,
    UnsupportedDtypeError,
)
from ._experts import ExpertKernel, ExpertWeights, TorchExperts  # noqa: E402
from ._output import DispatchOutput  # noqa: E402
from ._pending import Pending  # noqa: E402
from ._spec import DispatchSpec, QuantHints, add_cli_args  # noqa: E402
from ._trail import DtypeFallbackWarning, Resolution  # noqa: E402
from ._wire import DispatchDtype, Layout, Mode  # noqa: E402

if TYPE_CHECKING:
    from ._create import create_dispatcher
    from ._dispatcher import Dispatcher, run_experts
    from ._registry import PluginHost, available_backends

# Creation and the plugin host load with the first use of these names: importing the contract costs an engine little.
_LAZY = {"create_dispatcher": "_create", "Dispatcher": "_dispatcher", "run_experts": "_dispatcher",
         "PluginHost": "_registry", "available_backends": "_registry"}


def __getattr__(name: str) -> Any:
    if name == "__version__":  # the installed distribution's version (``moe-dispatch --version``)
        from ._loading import core_version
        return core_version()
    if name in _LAZY:
        import importlib
        value = globals()[name] = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BackendUnavailableError", "CallOrderError", "CapacityError", "CollectiveTimeoutError", "CommunicationError",
    "ConfigMismatchError", "DispatchDtype", "DispatchOutput", "DispatchSpec", "Dispatcher", "DtypeFallbackWarning",
    "ExpertKernel", "ExpertWeights", "InvalidInputError", "InvalidSpecError", "Layout", "MoEDispatchError", "Mode",
    "PeerFailedError", "Pending", "PluginError", "PluginHost", "QuantHints", "Resolution", "TorchExperts",
    "UnsupportedDtypeError", "add_cli_args", "available_backends", "create_dispatcher", "run_experts",
]
