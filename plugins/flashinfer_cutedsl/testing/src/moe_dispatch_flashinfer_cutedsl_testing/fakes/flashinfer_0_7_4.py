"""Fake of FlashInfer 0.7.4 (flashinfer-python==0.7.4): no ``MoeAlltoAll``; ``flashinfer.moe_ep``'s
``NVLinkOneSidedAlltoAll`` (``one_sided``, the fence path of an SM90 GPU); ``CuteDslMoEWrapper(clamped_relu2_limit=,
swap_ab=)``, ``run(nvfp4_4over6=)``; ``fp4_quantize(backend="auto", *, batch_invariant=)``.
"""

from . import cute_dsl, release

release.export(globals(), (0, 7, 4), None, cute_dsl.Wrapper_0_7_4)
