"""moe-dispatch: token dispatch and combine for expert-parallel MoE inference.

The names exported here are the contract engines and backend plugins code against.
"""

from ._torch_import import import_torch

import_torch()  # before anything imports torch: torch-npu without CANN must not break the import

from .backend import (
    Backend,
    BackendDispatcher,
    BufferSize,
    DispatchContext,
    FusedBackendDispatcher,
    RunnerInfo,
    SplitPhaseBackendDispatcher,
)
from .capabilities import Capabilities, DtypeDecision, Fallback, Limits
from .codecs import Codec, Quantized, make_codec
from .dispatcher import Dispatcher, create_dispatcher, run_experts
from .distributed.comm import Comm, Traffic
from .dtypes import DispatchDtype, Layout, Mode
from .errors import (
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
from .experts import ExpertKernel, ExpertWeights, TorchExperts, reference_moe
from .hints import QuantHints
from .commands import Command
from .hookspecs import API_VERSION, hookimpl
from .layer import MoELayer, moe_forward
from .output import DispatchOutput
from .pending import Pending
from .registry import BackendInfo, PluginHost, available_backends, core_version, get_backend
from .planning import BufferPlan, EnvRequirement, LayerBuffers, Misfit, Peak, plan_buffers
from .preparation import PreparedLayer, prepare_layer, resolve_output_dtype
from .trail import DtypeFallbackWarning, Resolution, Step
from .spec import DispatchSpec, add_cli_args
from .wire import WireFormat

#: The installed distribution's version (``moe-dispatch --version``).
__version__ = core_version()

__all__ = [
    "BufferPlan",
    "EnvRequirement",
    "LayerBuffers",
    "Misfit",
    "Peak",
    "plan_buffers",
    "API_VERSION",
    "Backend",
    "BackendDispatcher",
    "BackendInfo",
    "BackendUnavailableError",
    "BufferSize",
    "CallOrderError",
    "CollectiveTimeoutError",
    "Command",
    "Capabilities",
    "CapacityError",
    "Codec",
    "Comm",
    "CommunicationError",
    "ConfigMismatchError",
    "DispatchContext",
    "FusedBackendDispatcher",
    "DispatchDtype",
    "DispatchOutput",
    "DispatchSpec",
    "Dispatcher",
    "DtypeDecision",
    "DtypeFallbackWarning",
    "ExpertKernel",
    "ExpertWeights",
    "Fallback",
    "InvalidInputError",
    "InvalidSpecError",
    "Layout",
    "Limits",
    "MoEDispatchError",
    "MoELayer",
    "Mode",
    "PeerFailedError",
    "Pending",
    "PluginError",
    "SplitPhaseBackendDispatcher",
    "PluginHost",
    "QuantHints",
    "Quantized",
    "Resolution",
    "RunnerInfo",
    "Step",
    "TorchExperts",
    "Traffic",
    "UnsupportedDtypeError",
    "WireFormat",
    "add_cli_args",
    "available_backends",
    "create_dispatcher",
    "run_experts",
    "get_backend",
    "hookimpl",
    "make_codec",
    "moe_forward",
    "reference_moe",
    "PreparedLayer",
    "prepare_layer",
    "resolve_output_dtype",
]
