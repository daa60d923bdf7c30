"""A subcommand a plugin adds to ``moe-dispatch`` (``moe_dispatch_register_commands``).

The core never names a plugin's tools: a plugin that has something to say on the command line
(a hardware check, a vendor-specific report) registers a ``Command``; ``moe-dispatch`` adds it
beside the built-in subcommands and ``moe-dispatch backends`` lists where it came from.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Callable

from .errors import PluginError

#: The built-in subcommands and names kept for them; a plugin may not take one.
RESERVED_COMMAND_NAMES = frozenset({"backends", "explain", "demo", "bench", "plan", "help", "version"})
_NAME = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")


@dataclass(frozen=True)
class Command:
    """One ``moe-dispatch <name>`` subcommand.

    :param name: lower-case words joined by ``-``; best prefixed with the plugin's own name
        (``cuda-deepep-check``), since two distributions registering one name both lose it.
    :param help: the one line ``moe-dispatch --help`` shows.
    :param add_arguments: adds the subcommand's options to its ``argparse`` parser.
    :param run: runs it with the parsed options and returns the exit status; a
        ``MoEDispatchError`` it raises is printed as one line with exit status 2.
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise PluginError(
                "a command name is lower-case words joined by '-'", parameter="name", value=self.name,
                allowed="e.g. 'cuda-deepep-check'",
            )
        if self.name in RESERVED_COMMAND_NAMES:
            raise PluginError(
                "this command name belongs to moe-dispatch itself", parameter="name", value=self.name,
                allowed=f"any other name; taken: {', '.join(sorted(RESERVED_COMMAND_NAMES))}",
            )
        for field_name in ("add_arguments", "run"):
            if not callable(getattr(self, field_name)):
                raise PluginError(
                    f"Command.{field_name} must be callable", parameter=field_name,
                    value=getattr(self, field_name), allowed="a function",
                )
        if not isinstance(self.help, str):
            raise PluginError("Command.help is one line of text", parameter="help", value=self.help, allowed="str")


__all__ = ["RESERVED_COMMAND_NAMES", "Command"]
