"""Integrations with model libraries; each an extra (``moe-dispatch[transformers]``), never imported by
``import moe_dispatch``."""
