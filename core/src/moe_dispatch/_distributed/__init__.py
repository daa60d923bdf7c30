"""Process groups: the byte-counting ``Comm`` wrapper and the local rank spawner."""

from .comm import Comm, Traffic

__all__ = ["Comm", "Traffic"]
