"""The hooks a backend plugin implements, in the style of pytest's ``hookspec.py``. A plugin is a module named by an
entry point in the ``moe_dispatch.backends`` group; it declares the core API it was written for and implements any of
the hooks, with ``hookimpl`` from ``moe_dispatch.backend`` (never from pluggy)::

    MOE_DISPATCH_API = 1

    @mdb.hookimpl
    def moe_dispatch_register_backends(register):
        register(MyBackend())
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TypeVar, cast

import pluggy

from ._errors import PluginError

if TYPE_CHECKING:
    from ._contract import Backend, RunnerInfo

PROJECT = "moe_dispatch"
#: The core API version. A plugin states the one it was written for in its module-level ``MOE_DISPATCH_API``; the
#: host refuses a plugin whose version it does not support.
API_VERSION = 1
SUPPORTED_API_VERSIONS = frozenset({1})

F = TypeVar("F", bound=Callable[..., Any])
hookspec = pluggy.HookspecMarker(PROJECT)
#: Mark a plugin's hook implementations. Typed so decorated functions keep their signature.
hookimpl = cast(Callable[[F], F], pluggy.HookimplMarker(PROJECT))

#: The ``register`` callback each hook gets.
RegisterBackend = Callable[["Backend"], None]
RegisterRunner = Callable[["RunnerInfo"], None]
RegisterCommand = Callable[["Command"], None]


@hookspec
def moe_dispatch_register_backends(register: RegisterBackend) -> None:
    """Register the dispatch backends this plugin provides.

    Called once per plugin when the plugin host loads, before any dispatcher is created. Registration must be cheap
    and must not touch the hardware: import vendor libraries lazily, in ``Backend.probe`` and ``Backend.create``.

    :param register: call ``register(backend)`` once per ``Backend`` instance. A name registered by two
        distributions is an error that names both.
    """


@hookspec
def moe_dispatch_register_runners(register: RegisterRunner) -> None:
    """Register expert-kernel families (runners) and the wire dtype each needs.

    Resolution step 5 reads these: a spec whose ``runner`` names a family that needs BF16 (because its kernels
    quantize internally) gets BF16 unless an earlier step decided.

    :param register: call ``register(RunnerInfo(name, needs, reason))`` per family.
    """


@hookspec
def moe_dispatch_register_commands(register: RegisterCommand) -> None:
    """Register subcommands of ``moe-dispatch`` (a hardware check, a vendor report), added beside the built-in ones.
    Build the parser cheaply; import vendor libraries in ``Command.run``.

    :param register: call ``register(Command(name, help, add_arguments, run))`` per subcommand. A built-in's name is
        refused; a name registered by two distributions is left out and shown as a conflict by
        ``moe-dispatch backends``.
    """


#: The built-in subcommands and names kept for them; a plugin may not take one.
RESERVED_COMMAND_NAMES = frozenset({"backends", "explain", "plan", "help", "version"})
_NAME = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")


@dataclass(frozen=True)
class Command:
    """One ``moe-dispatch <name>`` subcommand.

    :param name: lower-case words joined by ``-``; best prefixed with the plugin's own name (``cuda-deepep-check``),
        since two distributions registering one name both lose it.
    :param help: the one line ``moe-dispatch --help`` shows.
    :param add_arguments: adds the subcommand's options to its ``argparse`` parser.
    :param run: runs it with the parsed options and returns the exit status; a ``MoEDispatchError`` it raises is
        printed as one line with exit status 2.
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise PluginError("a command name is lower-case words joined by '-'", parameter="name", value=self.name,
                              allowed="e.g. 'cuda-deepep-check'")
        if self.name in RESERVED_COMMAND_NAMES:
            raise PluginError("this command name belongs to moe-dispatch itself", parameter="name", value=self.name,
                              allowed=f"any other name; taken: {', '.join(sorted(RESERVED_COMMAND_NAMES))}")
        for field_name in ("add_arguments", "run"):
            if not callable(getattr(self, field_name)):
                raise PluginError(f"Command.{field_name} must be callable", parameter=field_name,
                                  value=getattr(self, field_name), allowed="a function")
        if not isinstance(self.help, str):
            raise PluginError("Command.help is one line of text", parameter="help", value=self.help, allowed="str")
