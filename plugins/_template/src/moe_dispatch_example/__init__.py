"""moe-dispatch-example: the plugin module the ``moe_dispatch.backends`` entry point names.

The core imports this module, checks ``MOE_DISPATCH_API``, and calls the hooks below.
"""

import moe_dispatch.backend as mdb

from .backend import ExampleBackend

#: The core API this plugin is written for; the core refuses a plugin it cannot serve.
MOE_DISPATCH_API = 1


@mdb.hookimpl
def moe_dispatch_register_backends(register):  # type: ignore[no-untyped-def]
    register(ExampleBackend())


__all__ = ["ExampleBackend", "MOE_DISPATCH_API", "moe_dispatch_register_backends"]
