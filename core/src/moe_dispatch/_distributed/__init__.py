"""Process groups: the byte-counting ``Comm`` wrapper, the ``Watch`` that waits without hanging when a peer fails,
and the agreement on a dispatcher's configuration."""

from .comm import Comm, Traffic

__all__ = ["Comm", "Traffic"]
