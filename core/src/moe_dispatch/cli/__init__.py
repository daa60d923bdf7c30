"""The ``moe-dispatch`` command and its applications (a wing: ``import moe_dispatch`` loads none
of it): ``main`` (backends, explain, demo, bench, plan), ``plan``, ``demo``, ``bench``, ``presets``."""

from .main import BACKENDS_JSON_SCHEMA, backends_report, build_parser, explain, main

__all__ = ["BACKENDS_JSON_SCHEMA", "backends_report", "build_parser", "explain", "main"]
