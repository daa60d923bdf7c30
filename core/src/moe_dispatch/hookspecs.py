"""The hooks a backend plugin implements, documented in the style of pytest's ``hookspec.py``.

A plugin is a module named by an entry point in the ``moe_dispatch.backends`` group. It
declares the core API it was written for and implements any of the hooks below::

    import moe_dispatch as md

    MOE_DISPATCH_API = 1

    @md.hookimpl
    def moe_dispatch_register_backends(register):
        register(MyBackend())

Plugins import ``hookimpl`` from ``moe_dispatch``, never from pluggy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeVar, cast

import pluggy

if TYPE_CHECKING:
    from .backend import Backend, RunnerInfo
    from .commands import Command

PROJECT = "moe_dispatch"

#: The core API version. A plugin states the one it was written for in its module-level
#: ``MOE_DISPATCH_API``; the host refuses a plugin whose version it does not support.
API_VERSION = 1
SUPPORTED_API_VERSIONS = frozenset({1})

F = TypeVar("F", bound=Callable[..., Any])
hookspec = pluggy.HookspecMarker(PROJECT)
_hookimpl = pluggy.HookimplMarker(PROJECT)
#: Mark a plugin's hook implementations. Typed so decorated functions keep their signature.
hookimpl = cast(Callable[[F], F], _hookimpl)


class RegisterBackend(Protocol):
    def __call__(self, backend: "Backend") -> None: ...


class RegisterRunner(Protocol):
    def __call__(self, runner: "RunnerInfo") -> None: ...


class RegisterCommand(Protocol):
    def __call__(self, command: "Command") -> None: ...


# -- registration -------------------------------------------------------------------------


@hookspec
def moe_dispatch_register_backends(register: RegisterBackend) -> None:
    """Register the dispatch backends this plugin provides.

    Called once per plugin when the plugin host loads, before any dispatcher is created.
    Registration must be cheap and must not touch the hardware: import vendor libraries
    lazily, in ``Backend.probe`` and ``Backend.create``.

    :param register: call ``register(backend)`` once per ``Backend`` instance. A name
        registered by two distributions is an error that names both.
    :returns: nothing; results go through ``register``.
    """


@hookspec
def moe_dispatch_register_runners(register: RegisterRunner) -> None:
    """Register expert-kernel families (runners) and the wire dtype each needs.

    Resolution step 5 reads these: a spec whose ``runner`` names a family that needs BF16
    (because its kernels quantize internally) gets BF16 unless an earlier step decided.

    :param register: call ``register(RunnerInfo(name, needs, reason))`` per family.
    :returns: nothing; results go through ``register``.
    """


@hookspec
def moe_dispatch_register_commands(register: RegisterCommand) -> None:
    """Register subcommands of ``moe-dispatch`` (a hardware check, a vendor report).

    The command line adds each beside its built-in subcommands, so the core never names a
    plugin's tools. Build the parser cheaply; import vendor libraries in ``Command.run``.

    :param register: call ``register(Command(name, help, add_arguments, run))`` per
        subcommand. A built-in's name is refused; a name registered by two distributions is
        left out and shown as a conflict by ``moe-dispatch backends``.
    :returns: nothing; results go through ``register``.
    """


__all__ = [
    "API_VERSION",
    "PROJECT",
    "SUPPORTED_API_VERSIONS",
    "hookimpl",
    "hookspec",
    "moe_dispatch_register_backends",
    "moe_dispatch_register_commands",
    "moe_dispatch_register_runners",
]
