"""A GDN layer's step inputs from its projections in one launch (a launch per token row of program):
``q, k`` L2-normalised (``q`` then scaled by ``K^-1/2``), ``g = −exp(A_log) · softplus(a + dt_bias)``,
``beta = sigmoid(b)`` rounded to ``b``'s dtype, ``v`` in float32, all float32 and contiguous.
:func:`pace_core.recurrence.prepare_qk` and :func:`pace_core.recurrence.gdn_gates` define them (``v.float()`` beside);
the reference runs them as about twenty small PyTorch kernels per decode step, a third of a state pool's step time
at B = 128 in a CUDA graph (the serving harness's profile, ``scripts/gpu_serving_harness.py --profile``).

Differences from the reference, per entry: ``q, k`` a float32 sum of ``K`` squares in another order and a hardware
``rsqrt`` (2 ulp); ``g`` the GPU's approximate ``exp`` and ``log`` (PTX ``ex2.approx``: 2 ulp plus the argument's
rounding, ``lg2.approx``: 2^-22.6 absolute); ``beta`` may round to the neighbouring value of ``b``'s dtype where the
float32 sigmoid lies within that of a rounding boundary. tests/test_kernels_step_inputs.py states the bounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pace_core.errors import PaceError
from pace_core.recurrence import L2NORM_EPS

from .primitives import round_bf16

ROUNDING = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""``beta``'s rounding by ``b``'s dtype (:func:`pace_core.recurrence.gdn_gates` computes the sigmoid in it)."""


@triton.jit
def _round_to(x, ROUND: tl.constexpr):
    """``x`` float32 rounded to the nearest bfloat16 (``ROUND`` 1, :func:`kernels.primitives.round_bf16`) or float16
    (2), as float32; unchanged for 0."""
    if ROUND == 1:
        x = round_bf16(x)
    elif ROUND == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _inputs_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, qo_ptr, ko_ptr, vo_ptr, go_ptr, bo_ptr,
                   q_row, k_row, v_row, a_row, b_row, H, HV, eps, scale, K: tl.constexpr, V: tl.constexpr,
                   BH: tl.constexpr, BHV: tl.constexpr, ROUND: tl.constexpr):
    """Token row ``program_id(0)``: ``q, k [H, K]``, ``v [HV, V]``, ``a, b [HV]`` at their row strides (elements;
    each row's heads contiguous) -> the outputs' row, contiguous (module docstring)."""
    r = tl.program_id(0).to(tl.int64)
    hk = tl.arange(0, BH)[:, None]
    kk = tl.arange(0, K)[None, :]
    at = hk * K + kk
    mk = hk < H
    q = tl.load(q_ptr + r * q_row + at, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + r * k_row + at, mask=mk, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=1) + eps)[:, None] * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=1) + eps)[:, None]
    tl.store(qo_ptr + r * H * K + at, q, mask=mk)
    tl.store(ko_ptr + r * H * K + at, k, mask=mk)

    hv = tl.arange(0, BHV)
    mv = hv < HV
    vat = hv[:, None] * V + tl.arange(0, V)[None, :]
    v = tl.load(v_ptr + r * v_row + vat, mask=mv[:, None], other=0.0).to(tl.float32)
    tl.store(vo_ptr + r * HV * V + vat, v, mask=mv[:, None])

    x = tl.load(a_ptr + r * a_row + hv, mask=mv, other=0.0).to(tl.float32) + \
        tl.load(dtb_ptr + hv, mask=mv, other=0.0).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # torch's threshold
    g = -tl.exp(tl.load(alog_ptr + hv, mask=mv, other=0.0).to(tl.float32)) * softplus
    beta = _round_to(1.0 / (1.0 + tl.exp(-tl.load(b_ptr + r * b_row + hv, mask=mv, other=0.0).to(tl.float32))),
                     ROUND)
    tl.store(go_ptr + r * HV + hv, g, mask=mv)
    tl.store(bo_ptr + r * HV + hv, beta, mask=mv)


def refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor) -> str | None:
    """Why :func:`step_inputs` does not take these inputs (then the reference computes them), or None: float64 ``q``
    or ``k`` (the reference normalises them in float64), ``b`` of another dtype than its rounding's, head dims not
    powers of two."""
    K, V = q.shape[-1], v.shape[-1]
    if torch.float64 in (q.dtype, k.dtype) or b.dtype not in ROUNDING:
        return f"{q.dtype} / {k.dtype} / {b.dtype} inputs compute on the reference"
    if K & (K - 1) or V & (V - 1):
        return f"head dims {K}, {V} are not powers of two"
    return None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x [T, ...]`` with each row's entries contiguous (a view where they are: the projections' split)."""
    inner = x[0] if x.shape[0] else x
    return x if inner.is_contiguous() and x.stride(-1) == 1 else x.contiguous()


def step_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                A_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``q, k [T, H, K]``, ``v [T, HV, V]``, ``a, b [T, HV]`` (one row per token, each row's entries contiguous or
    copied so; float32, bfloat16 or float16) and the layer's ``A_log, dt_bias [HV]`` -> ``(q, k, v, g, beta)``
    float32, contiguous (module docstring)."""
    T, H, K = q.shape
    HV, V = v.shape[1:]
    if k.shape != q.shape or v.shape[0] != T or a.shape != (T, HV) or b.shape != (T, HV) or \
            A_log.shape != (HV,) or dt_bias.shape != (HV,):
        raise PaceError(f"step inputs: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, a {tuple(a.shape)}, "
                        f"b {tuple(b.shape)}, A_log {tuple(A_log.shape)}, dt_bias {tuple(dt_bias.shape)} not allowed; "
                        "allowed: q, k [T, H, K], v [T, HV, V], a, b [T, HV], A_log, dt_bias [HV]")
    why = refusal(q, k, v, b)
    if why:
        raise PaceError(f"step inputs: {why}; allowed: float32, bfloat16 or float16, head dims powers of two")
    q, k, v, a, b = (_rows(x) for x in (q, k, v, a, b))
    out = [torch.empty(x.shape, dtype=torch.float32, device=q.device) for x in (q, k, v, a, b)]
    if T:
        _inputs_kernel[(T,)](q, k, v, a, b, A_log.contiguous(), dt_bias.contiguous(), *out, q.stride(0), k.stride(0),
                             v.stride(0), a.stride(0), b.stride(0), H, HV, L2NORM_EPS, K**-0.5, K=K, V=V,
                             BH=triton.next_power_of_2(H), BHV=triton.next_power_of_2(HV), ROUND=ROUNDING[b.dtype],
                             num_warps=4)
    return tuple(out)
