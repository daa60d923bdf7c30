from __future__ import annotations

import pytest

from moe_dispatch.distributed.local import RankPool


class Pools:
    """Local gloo rank pools shared by the whole session, one per world size."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def get(self, world_size: int) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive:
            pool = RankPool(world_size, timeout_s=60)
            self._pools[world_size] = pool
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close(force=not pool.alive)


@pytest.fixture(scope="session")
def pools():
    p = Pools()
    yield p
    p.close()
