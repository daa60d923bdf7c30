"""The conformance kit on FuseEP: the unfused INT8 path, and the fused forward on W8A8 weights."""

import torch

import moe_dispatch as md
from moe_dispatch.backend import quantize_weights_w8a8
from moe_dispatch_ascend_fuseep import vendor as v
from moe_dispatch_ascend_fuseep.backend import FuseEPBackend
from moe_dispatch_ascend_fuseep_testing import FAKE, fuseep_backend
from moe_dispatch_testing import BackendConformance, KitShape

#: fused_deep_moe (fuse mode 1) takes gmm1 N = 2I in 1024..6144; the kit's experts have I = 128.
FUSED_INTERMEDIATE = v.MIN_GMM1_HIDDEN // 2


def w8a8_at_fused_intermediate(weights: md.ExpertWeights) -> md.ExpertWeights:
    """The kit's experts with I padded by zero channels to what the op takes (SwiGLU(0)·0 adds
    nothing: the layer computes the same function), then W8A8; the reference gets the same."""
    w13, w2 = weights.w13_weight, weights.w2_weight
    e, two_i, h = w13.shape
    i, pad = two_i // 2, FUSED_INTERMEDIATE - two_i // 2
    zeros = w13.new_zeros(e, pad, h)
    w13 = torch.cat([w13[:, :i], zeros, w13[:, i:], zeros], dim=1)
    w2 = torch.cat([w2, w2.new_zeros(e, h, pad)], dim=2)
    return quantize_weights_w8a8(md.ExpertWeights(w13, w2))


def on_the_fake() -> FuseEPBackend:
    return fuseep_backend(FAKE)  # HCCL_BUFFSIZE from the process environment (conftest)


class TestFuseEPOnTheFake(BackendConformance):
    backend_name = "ascend_fuseep"
    backend_factory = on_the_fake
    kit_shape = KitShape(hidden_size=1024)
    kit_weights = w8a8_at_fused_intermediate  # the fused op takes nothing else


class TestFuseEPMode2OnTheFake(TestFuseEPOnTheFake):
    backend_options = {"fuse_mode": 2}
    world_sizes = (2,)  # the unfused path is mode 1's; the fused op's mode 2 on two ranks
