"""The ``moe-dispatch`` command: ``backends``, ``explain``, ``plan``, and the subcommands plugins register
(``moe_dispatch_register_commands``). ``import moe_dispatch`` loads none of it. Command authors may use ``explain``
(``create_dispatcher``'s own preparation of a spec), the model shapes of ``presets`` and the flag types of ``flags``."""

from .explain import explain
from .main import main

__all__ = ["explain", "main"]
