"""The reference backends on torch.distributed (``torch``, ``allgather``), registered through the same hook as any
plugin."""

#: Modules of hookimpls the plugin host registers before any entry point.
BUILTIN_PLUGINS = ("moe_dispatch._reference.builtin",)

__all__ = ["BUILTIN_PLUGINS"]
