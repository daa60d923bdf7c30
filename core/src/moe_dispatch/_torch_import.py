"""Import torch where an installed device backend cannot load: torch imports every installed device-backend
extension and raises if one fails, as torch-npu does without the Ascend runtime (CANN). When torch is not imported
yet, torch-npu is installed and no CANN environment is set, the import runs with ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``
(restored right after); the ascend plugins import torch-npu when they probe, and say why it is unusable. This module
must not import torch at module level.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

AUTOLOAD = "TORCH_DEVICE_BACKEND_AUTOLOAD"
#: Set by CANN's set_env.sh; without any of them torch-npu cannot load.
CANN_ENV = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH")


def npu_autoload_would_fail(env: "os._Environ[str] | dict[str, str]" = os.environ) -> bool:
    return (AUTOLOAD not in env and not any(k in env for k in CANN_ENV)
            and importlib.util.find_spec("torch_npu") is not None)


def import_torch() -> None:
    if "torch" in sys.modules or not npu_autoload_would_fail():
        importlib.import_module("torch")  # the caller's (or torch's default) behaviour stands
        return
    from ._environ import restored_environ
    with restored_environ({AUTOLOAD: "0"}):
        importlib.import_module("torch")


__all__ = ["import_torch", "npu_autoload_would_fail"]
