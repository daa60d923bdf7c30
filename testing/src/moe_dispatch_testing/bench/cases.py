"""What one benchmark configuration is, and the grid the command line expands to."""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product
from typing import Iterable

from moe_dispatch import DispatchDtype, InvalidSpecError, Mode


@dataclass(frozen=True)
class BenchCase:
    """One (backend, dtype, mode, world size, tokens per rank, shape) point."""

    backend: str
    dtype: DispatchDtype
    mode: Mode
    world_size: int
    tokens_per_rank: int
    hidden: int
    experts: int
    top_k: int
    model: str = "custom"
    layout: str | None = None  # DispatchSpec.layout (benchmarks/token_major.py)

    def __post_init__(self) -> None:
        for name in ("world_size", "tokens_per_rank", "hidden", "experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidSpecError("must be a positive int", parameter=name, value=value, allowed=">= 1")
        if self.experts % self.world_size:
            raise InvalidSpecError(
                f"{self.experts} experts cannot be split evenly over {self.world_size} ranks",
                parameter="world_size", value=self.world_size, allowed=f"a divisor of {self.experts}",
            )

    @property
    def label(self) -> str:
        return (f"{self.backend} {self.dtype.value} {self.mode.value} R={self.world_size} "
                f"T={self.tokens_per_rank} H={self.hidden}")

    def with_backend(self, backend: str) -> "BenchCase":
        return replace(self, backend=backend)


@dataclass(frozen=True)
class BenchSettings:
    """How each case is measured."""

    warmup: int = 3
    iterations: int = 20
    seed: int = 0
    check_inputs: bool = False  # value checks read the data: a cost the bench reports separately
    device: str = "cpu"  # "cuda" under torchrun with NCCL (benchmarks/gpu)

    def __post_init__(self) -> None:
        if self.iterations < 1:
            raise InvalidSpecError("must be >= 1", parameter="iterations", value=self.iterations, allowed=">= 1")
        if self.warmup < 0:
            raise InvalidSpecError("must be >= 0", parameter="warmup", value=self.warmup, allowed=">= 0")


@dataclass(frozen=True)
class Shape:
    model: str
    hidden: int
    experts: int
    top_k: int


def expand_cases(
    backends: Iterable[str],
    dtypes: Iterable[DispatchDtype],
    modes: Iterable[Mode],
    world_sizes: Iterable[int],
    tokens: Iterable[int],
    shapes: Iterable[Shape],
) -> list[BenchCase]:
    """Every combination, world size outermost so one pool of ranks serves a run of cases."""
    return [
        BenchCase(b, d, m, r, t, s.hidden, s.experts, s.top_k, s.model)
        for r, s, b, m, d, t in product(list(world_sizes), list(shapes), list(backends), list(modes),
                                        list(dtypes), list(tokens))
    ]


__all__ = ["BenchCase", "BenchSettings", "Shape", "expand_cases"]
