"""moe-dispatch-testing: the conformance kit every backend passes, and what to write more tests with.

``BackendConformance`` is the suite (subclass it, set ``backend_name``); the pytest plugin
(``moe_dispatch_testing.plugin``, loaded through ``pytest11``) provides ``moe_rank_pools``,
``moe_dense_reference`` and ``moe_routing``; ``check_layer`` runs one layer through a plugin's
expert kernel against the dense reference; ``RankPool``/``run_local`` run a function on local gloo
ranks. Names load on first use, so the ``demo``/``bench`` commands' registration stays cheap.
See docs/writing-a-backend.md.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "accuracy": ("TOLERANCES", "reference_moe", "relative_error"),
    "cases": ("Case", "GlobalBatch", "KitShape", "Routing", "Target", "standard_routings"),
    "conformance": ("WORLD_SIZES", "BackendConformance"),
    "experts": ("IdentityExperts", "ScaledIdentityExperts", "ScaledLayer", "expert_factor"),
    "host_reads": ("HOST_READS", "RecordedOps"),
    "layers": ("LayerCheck", "check_layer"),
    "local": ("RankPool", "one_rank_group", "run_local"),
    "outcomes": ("Outcome", "combine_unless_stalled", "dispatch_with_a_bad_id", "outcome"),
    "pools": ("RankPools", "on_a_fresh_pool"),
    "ranks": ("RoutingReuse", "routing_reuse"),
    "routing": ("random_expert_weights", "random_routing"),
    "streams": ("captured", "run_started"),
}
_MODULE_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
