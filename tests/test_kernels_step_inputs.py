"""kernels.step_inputs: a GDN layer's step inputs from its projections in one launch, against the float64 formulas
(pace_core.recurrence.prepare_qk, gdn_gates) with bounds derived from the float32 arithmetic and the GPU's
approximate units (interpreted on the CPU, compiled with ``PACE_KERNEL_TESTS=cuda``).

``U = 2^-24`` (float32's unit roundoff; one ulp is at most ``2 U`` relative). Per entry:

- ``q, k``: the inputs' cast is exact; a float32 sum of ``K`` squares in any order is off by ``(K - 1) U`` relative,
  its square root halves that; ``rsqrt`` (PTX ``rsqrt.approx``, 2 ulp) ``4 U``; the two products and the rounded
  ``K^-1/2`` ``3 U``: at most ``(K / 2 + 8) U`` relative.
- ``g = −e^A softplus(x)``, ``x = a + dt_bias``: ``x``'s rounding moves softplus by at most ``|x| U`` (its slope is
  below 1); ``e^x`` (``ex2.approx`` of ``x log2 e``: 2^-22 relative plus the argument's rounding, ``|x| U``), as
  ``log(1 + e)``'s input, moves it by that share of softplus (``e / (1 + e) <= log(1 + e)``); ``1 + e`` rounded
  ``U``; ``lg2.approx`` 2^-22.6 absolute in log2, ``2^-23`` in log; ``e^A`` ``|A| U + 2^-22``; the product ``U``. So
  ``|Δg| <= e^A (2^-23 + U + |x| U + sp (|x| U + |A| U + 2^-21 + 2 U))``; the test allows twice each term.
- ``beta``: the float32 sigmoid (``1 / (1 + e^-b)``: ``(|b| + 2) U`` for ``e^-b``, ``U`` the sum, 2 ulp the
  division) then the rounding to ``b``'s dtype: equal to the reference's except where the sigmoid lies within that
  of a rounding boundary (then one ulp of that dtype: at most 1 % of the entries here); float32 ``b``: at most
  ``(|b| + 8) U`` relative, twice allowed.
- ``v``: the cast, exact.
"""

from __future__ import annotations

import pytest
import torch
from kernels_support import DEVICE, ON_GPU, kernel_modules

from pace_core.backend import REFERENCE
from pace_core.errors import PaceError
from pace_core.recurrence import prepare_qk

KERNELS = kernel_modules()
inputs = KERNELS["step_inputs"]
U = 2.0**-24
H, HV, K, V = (16, 32, 128, 128) if ON_GPU else (3, 6, 16, 32)
"""Key heads (not a power of two on the CPU: the masked rows), value heads, head dims."""
T = 40 if ON_GPU else 5


def projections(dtype: torch.dtype, seed: int):
    """A layer's projections for ``T`` tokens as the plugin splits them (views of one ``[T, 2HK + HV V + 2HV]``
    matrix: rows not contiguous) and its ``A_log, dt_bias``, drawn on the CPU and moved to the tests' device."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("cpu"):
        x = torch.randn(T, 2 * H * K + HV * V + 2 * HV, generator=gen) * 2.0
        x[:, -2 * HV:] *= 6.0  # gates over softplus's and sigmoid's whole range, beyond softplus's threshold of 20
        A_log = torch.rand(HV, generator=gen) * 4.0 - 2.0
        dt_bias = torch.rand(HV, generator=gen)
    x = x.to(dtype).to(DEVICE)
    q, k, v, a, b = x.split([H * K, H * K, HV * V, HV, HV], dim=-1)
    return (q.unflatten(-1, (H, K)), k.unflatten(-1, (H, K)), v.unflatten(-1, (HV, V)), a, b,
            A_log.to(dtype).to(DEVICE), dt_bias.to(dtype).to(DEVICE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_step_inputs_are_the_formulas_within_float32_and_the_gpus_units(dtype: torch.dtype) -> None:
    proj = projections(dtype, seed=1)
    assert not proj[0].is_contiguous()  # the row stride of the projection matrix
    q, k, v, g, beta = inputs.step_inputs(*proj)
    for t in (q, k, v, g, beta):
        assert t.dtype == torch.float32 and t.is_contiguous()
    q64, k64 = prepare_qk(proj[0].double(), proj[1].double())
    bound = (K / 2 + 8) * U
    assert ((q.double() - q64).abs() <= bound * q64.abs()).all()
    assert ((k.double() - k64).abs() <= bound * k64.abs()).all()
    assert torch.equal(v, proj[2].float())

    a, b, A_log, dt_bias = (t.double() for t in proj[3:])
    x = a + dt_bias
    sp = torch.nn.functional.softplus(x)
    g64 = -A_log.exp() * sp
    allowed = A_log.exp() * 2 * (2.0**-23 + U + x.abs() * U + sp * ((x.abs() + A_log.abs()) * U + 2.0**-21 + 2 * U))
    assert ((g.double() - g64).abs() <= allowed).all()

    ref_beta = REFERENCE.step_inputs(*proj)[4]  # the sigmoid in b's dtype, as the layer computes it
    if dtype == torch.float32:
        assert ((beta.double() - b.sigmoid()).abs() <= 2 * (b.abs() + 8) * U * b.sigmoid()).all()
    else:
        ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
        apart = (beta - ref_beta).abs() / ref_beta.abs().clamp_min(2.0**-14)
        assert (apart <= ulp).all() and (beta == ref_beta).float().mean() >= 0.99


def test_the_backend_takes_what_the_kernel_takes_and_else_the_reference() -> None:
    """The kernels' backend runs the launch for float32 / bfloat16 / float16 inputs and the reference's formulas for
    float64 (bit for bit: the same code)."""
    backend = KERNELS["backend"].TritonSteps()
    proj = projections(torch.float64, seed=2)
    assert inputs.refusal(*proj[:3], proj[4]) == \
        "torch.float64 / torch.float64 / torch.float64 inputs compute on the reference"
    for got, ref in zip(backend.step_inputs(*proj), REFERENCE.step_inputs(*proj)):
        assert torch.equal(got, ref)
    proj = projections(torch.bfloat16, seed=2)
    assert inputs.refusal(*proj[:3], proj[4]) is None
    for got, ref in zip(backend.step_inputs(*proj), inputs.step_inputs(*proj)):
        assert torch.equal(got, ref)


def test_no_rows_and_wrong_shapes() -> None:
    q, k, v, a, b, A_log, dt_bias = projections(torch.bfloat16, seed=3)
    empty = inputs.step_inputs(q[:0], k[:0], v[:0], a[:0], b[:0], A_log, dt_bias)
    assert [tuple(t.shape) for t in empty] == [(0, H, K), (0, H, K), (0, HV, V), (0, HV), (0, HV)]
    with pytest.raises(PaceError, match=rf"step inputs: .* b \({T - 1}, {HV}\).* allowed: q, k \[T, H, K\]"):
        inputs.step_inputs(q, k, v, a, b[1:], A_log, dt_bias)
