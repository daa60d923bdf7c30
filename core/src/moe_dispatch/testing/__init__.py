"""The conformance kit: the suite every backend passes, and the fixtures to write more tests.

``BackendConformance`` is the suite (subclass it, set ``backend_name``); the pytest plugin in
``moe_dispatch.testing.plugin`` (loaded automatically through the ``pytest11`` entry point)
provides ``moe_rank_pools``, ``moe_dense_reference`` and ``moe_routing``; ``check_layer`` runs one layer
through a plugin's expert kernel against the dense reference. See
``docs/writing-a-backend.md``.
"""

from typing import Any

from ..experts import reference_moe as dense_reference
from ..routing import random_routing
from .cases import Case, GlobalBatch, KitShape, Routing, Target, standard_routings
from .experts import IdentityExperts, ScaledIdentityExperts, ScaledLayer, expert_factor
from .layers import LayerCheck, check_layer
from .outcomes import Outcome, combine_unless_stalled, dispatch_with_a_bad_id, outcome
from .pools import RankPools, on_a_fresh_pool
from .ranks import RoutingReuse, routing_reuse


def __getattr__(name: str) -> Any:
    # The suite is a pytest class: it imports pytest, which a hardware script using the kit's
    # experts on a device machine may not have.
    if name in ("BackendConformance", "WORLD_SIZES"):
        from . import conformance

        return getattr(conformance, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "WORLD_SIZES",
    "BackendConformance",
    "Case",
    "GlobalBatch",
    "IdentityExperts",
    "KitShape",
    "LayerCheck",
    "Outcome",
    "RankPools",
    "RoutingReuse",
    "Routing",
    "ScaledIdentityExperts",
    "ScaledLayer",
    "Target",
    "check_layer",
    "combine_unless_stalled",
    "dense_reference",
    "dispatch_with_a_bad_id",
    "expert_factor",
    "on_a_fresh_pool",
    "outcome",
    "random_routing",
    "routing_reuse",
    "standard_routings",
]
