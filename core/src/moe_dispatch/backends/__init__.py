"""The built-in backends, registered through the same hook as any plugin."""

#: Modules of hookimpls the plugin host registers before any entry point.
BUILTIN_PLUGINS = ("moe_dispatch.backends.builtin",)

__all__ = ["BUILTIN_PLUGINS"]
