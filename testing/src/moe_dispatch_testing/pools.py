"""Local gloo rank pools shared by a whole test session, one per world size."""

from __future__ import annotations

from typing import Any, Callable

from moe_dispatch_testing.local import RankPool

#: Seconds a collective may wait before gloo gives up; generous for a loaded CI machine.
DEFAULT_TIMEOUT_S = 60.0


class RankPools:
    """``get(world_size)`` returns a live pool of that many local ranks, starting it on first
    use and again after a task failed in it (a rank that raised may have left the others in
    a collective, so the next test gets fresh processes rather than a knock-on failure)."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._pools: dict[int, RankPool] = {}

    def get(self, world_size: int) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive or not pool.healthy:
            if pool is not None:
                pool.close(force=True)
            pool = RankPool(world_size, timeout_s=self.timeout_s)
            self._pools[world_size] = pool
        return pool

    def on_every_live_rank(self, fn: "Callable[..., Any]") -> None:
        """Run ``fn(rank, world_size)`` on every rank of every live, healthy pool (outcomes
        ignored): what a plugin's fixture uses to reset per-process state its fakes keep (a lost
        CUDA context, NVSHMEM) between tests, as a new process would start without it."""
        for pool in list(self._pools.values()):
            if pool.alive and pool.healthy:
                pool.try_map(fn)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close(force=not pool.alive)
        self._pools.clear()


def on_a_fresh_pool(fn: "Callable[..., Any]", *args: Any, world_size: int = 2, timeout_s: float = 40.0) -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank of a pool of its own, closed after: for tests
    that leave a collective unfinished in the process group (a rank that failed or stalled)."""
    pool = RankPool(world_size)
    try:
        return pool.map(fn, *args, timeout_s=timeout_s)
    finally:
        pool.close(force=True)


__all__ = ["DEFAULT_TIMEOUT_S", "RankPools", "on_a_fresh_pool"]
