"""Fake of FlashInfer 0.7.2.

Models 0.7.2 (flashinfer-python==0.7.2.post1): as ``flashinfer_0_7_1``, and ``MoeAlltoAll``
deprecated (``@typing_extensions.deprecated``: a DeprecationWarning at every construction).
"""

from . import a2a, cute_dsl, release

release.export(globals(), (0, 7, 2), a2a.MoeAlltoAll_0_7_1, cute_dsl.Wrapper_0_6_18)
