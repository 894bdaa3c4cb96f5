"""The full-precision references (method ``none``): the checkpoint is the plain state in the reference dtype
(float32 or bfloat16); its "rounding" is that cast, none at all for float32 (PACE_SPEC §6: FP32, BF16)."""

from __future__ import annotations

from fractions import Fraction

import torch

from pace_core import quant
from pace_core.checkpoint import StateFormat
from pace_core.methods.base import Method, register


class DenseFormat(StateFormat):
    """The plain tensor in ``cfg.reference_dtype``."""

    def __init__(self, cfg, bits_per_head, layer=None, name="state", gdn_index=0) -> None:
        super().__init__(cfg, bits_per_head, layer, name, gdn_index)
        self.dtype = getattr(torch, cfg.reference_dtype)

    def store_loaded(self, S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        quant.check_finite(S, self.name)
        c = S.to(self.dtype)
        return c, c.float()

    def load(self, c: torch.Tensor) -> torch.Tensor:
        return c.float()


METHOD = register(Method(
    name="none", order=0, label="Reference", quantized=False, strategy=None, kernels=True, pool=True,
    description="no quantisation: the checkpoint is kept in the reference dtype (fp32 or bf16)",
    reads=("reference_dtype",), format=DenseFormat,
    payload=lambda cfg, shape: (Fraction(cfg.bits), Fraction(0)),
    layer_bytes=lambda cfg, shape, n, layer: n * shape.num_v_heads * shape.d_k * shape.d_v * cfg.bits // 8,
    named={"fp32": dict(bits=32, reference_dtype="float32", decode_period=1, buffer="fp32"),
           "bf16": dict(bits=16, reference_dtype="bfloat16", decode_period=1, buffer="fp32")},
    tags={"fp32": ("memory-page", "capacity-baseline", "pool", "serve-check"),
          "bf16": ("cli-default", "all", "memory-page", "capacity-baseline", "pool", "serve-check")}))
