"""Tests of pace_core.recurrence against independent references (float64 loops, transformers)."""

import math

import pytest
import torch
import torch.nn.functional as F
from numerics import fp32_bound, rel
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from pace_core.buffer import DecodeBuffer
from pace_core.errors import PaceError
from pace_core.recurrence import (
    L2NORM_EPS,
    RECURRENT_BELOW,
    buffered_step,
    fold,
    gdn_chunked,
    gdn_recurrent,
    gdn_segment,
    prepare_qk,
)

pytestmark = pytest.mark.numerics


def make_inputs(B, T, H, gamma, K, V, dtype=torch.float64, seed=0, alpha_range=(0.5, 1.0), initial=True):
    """Raw GDN inputs shaped as in Qwen3.5: q, k prepared; g = log α with α in alpha_range."""
    gen = torch.Generator().manual_seed(seed)
    HV = H * gamma
    q, k = prepare_qk(torch.randn(B, T, H, K, generator=gen, dtype=dtype),
                      torch.randn(B, T, H, K, generator=gen, dtype=dtype))
    v = torch.randn(B, T, HV, V, generator=gen, dtype=dtype)
    lo, hi = alpha_range
    alpha = lo + (hi - lo) * torch.rand(B, T, HV, generator=gen, dtype=dtype)
    g = alpha.log()
    beta = torch.rand(B, T, HV, generator=gen, dtype=dtype)
    S0 = torch.randn(B, HV, K, V, generator=gen, dtype=dtype) if initial else None
    return q, k, v, g, beta, S0


def loop_reference(q, k, v, g, beta, S0):
    """Independent float64 reference: explicit loops over batch, value head and token."""
    B, T, H, K = k.shape
    HV, V = v.shape[2:]
    gamma = HV // H
    o = torch.zeros(B, T, HV, V, dtype=torch.float64)
    S_all = S0.double().clone()
    for b in range(B):
        for h in range(HV):
            S = S_all[b, h]
            for t in range(T):
                kt, qt = k[b, t, h // gamma].double(), q[b, t, h // gamma].double()
                S = math.exp(float(g[b, t, h])) * S
                u = float(beta[b, t, h]) * (v[b, t, h].double() - S.T @ kt)
                S = S + torch.outer(kt, u)
                o[b, t, h] = S.T @ qt
            S_all[b, h] = S
    return o, S_all


@pytest.mark.parametrize("gamma", [1, 2, 3])
def test_recurrent_matches_loop_reference(gamma):
    q, k, v, g, beta, S0 = make_inputs(2, 9, 2, gamma, 6, 5, seed=gamma)
    o, S = gdn_recurrent(q, k, v, g, beta, S0)
    o_ref, S_ref = loop_reference(q, k, v, g, beta, S0)
    assert o.dtype == torch.float64 and S.shape == S0.shape
    assert rel(o, o_ref) < 1e-13
    assert rel(S, S_ref) < 1e-13


@pytest.mark.parametrize("gamma", [1, 2, 3])
def test_matches_transformers_reference(gamma):
    """Conventions (l2norm eps, q scaling, GQA head mapping) agree with transformers' fp32 code."""
    gen = torch.Generator().manual_seed(10 + gamma)
    B, T, H, K, V = 2, 13, 2, 16, 8
    HV = H * gamma
    q_raw, k_raw = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = -F.softplus(torch.randn(B, T, HV, generator=gen))
    beta = torch.rand(B, T, HV, generator=gen)
    S0 = torch.randn(B, HV, K, V, generator=gen)
    o_hf, S_hf = torch_recurrent_gated_delta_rule(
        q_raw, k_raw, v, g, beta, initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    q, k = prepare_qk(q_raw, k_raw)
    o, S = gdn_recurrent(q, k, v, g, beta, S0)
    assert rel(o, o_hf) < 1e-5 and rel(S, S_hf) < 1e-5
    o_hfc, S_hfc = torch_chunk_gated_delta_rule(
        q_raw, k_raw, v, g, beta, chunk_size=4, initial_state=S0, output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    oc, Sc = gdn_chunked(q, k, v, g, beta, S0, chunk_size=5)
    assert rel(oc, o_hfc) < 1e-5 and rel(Sc, S_hfc) < 1e-5


def test_prepare_qk_formula():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 2, 7, generator=gen, dtype=torch.float64)
    k = torch.randn(3, 4, 2, 7, generator=gen, dtype=torch.float64) * 1e-4
    qp, kp = prepare_qk(q, k)
    assert torch.allclose(kp, k / torch.sqrt((k * k).sum(-1, keepdim=True) + L2NORM_EPS), rtol=1e-14, atol=0)
    expected_q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / math.sqrt(7)
    assert torch.allclose(qp, expected_q, rtol=1e-14, atol=0)
    # tiny keys are not blown up to unit length: eps dominates
    assert float(kp.norm(dim=-1).max()) < 0.5
    assert prepare_qk(q.float(), k.bfloat16())[1].dtype == torch.float32


@pytest.mark.parametrize("gamma", [1, 2, 3])
@pytest.mark.parametrize("chunk_size", [1, 3, 5, 8, 16, 64])
def test_chunked_equals_recurrent_fp64(gamma, chunk_size):
    q, k, v, g, beta, S0 = make_inputs(2, 21, 2, gamma, 8, 6, seed=100 * gamma + chunk_size)
    o_ref, S_ref = gdn_recurrent(q, k, v, g, beta, S0)
    o, S = gdn_chunked(q, k, v, g, beta, S0, chunk_size=chunk_size)
    assert o.shape == o_ref.shape
    assert rel(o, o_ref) < 1e-12
    assert rel(S, S_ref) < 1e-12


def test_chunked_zero_initial_state_and_fp32():
    q, k, v, g, beta, _ = make_inputs(1, 40, 2, 2, 16, 16, dtype=torch.float32, seed=5, initial=False)
    o_ref, S_ref = gdn_recurrent(q.double(), k.double(), v.double(), g.double(), beta.double())
    o, S = gdn_chunked(q, k, v, g, beta, chunk_size=16)
    assert o.dtype == torch.float32
    assert rel(o, o_ref) < 1e-5 and rel(S, S_ref) < 1e-5


def test_chunked_strong_decay_no_overflow():
    """Strong decays (α down to e^-30) must not produce inf/NaN inside a chunk."""
    q, k, v, _, beta, S0 = make_inputs(1, 32, 1, 2, 4, 4, seed=8)
    g = -30 * torch.rand(1, 32, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    o_ref, S_ref = gdn_recurrent(q, k, v, g, beta, S0)
    o, S = gdn_chunked(q, k, v, g, beta, S0, chunk_size=32)
    assert torch.isfinite(o).all()
    assert rel(o, o_ref) < 1e-12 and rel(S, S_ref) < 1e-12


def test_buffered_step_appends_record():
    q, k, v, g, beta, S0 = make_inputs(1, 2, 1, 2, 4, 3, seed=2)
    buf = DecodeBuffer(1, 1, 2, 4, 3, 4, "fp64")
    buffered_step(S0, buf, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
    buffered_step(S0, buf, q[:, 1], k[:, 1], v[:, 1], g[:, 1], beta[:, 1])
    assert len(buf) == 2
    assert torch.equal(buf.keys(), k) and torch.equal(buf.log_decays(), g)
    # u_1 = β_1 (v_1 - α_1 S_0ᵀ k_1) with the per-head key
    u0 = beta[0, 0, :, None] * (v[0, 0] - g[0, 0].exp()[:, None] * torch.einsum("k,hkv->hv", k[0, 0, 0], S0[0]))
    assert torch.allclose(buf.values()[0, 0], u0, rtol=1e-13, atol=1e-13)


def test_fold_empty_buffer_is_checkpoint():
    S0 = torch.randn(2, 4, 3, 5, dtype=torch.float64)
    buf = DecodeBuffer(2, 2, 4, 3, 5, 3, "fp64")
    S = fold(S0, buf)
    assert torch.equal(S, S0) and S.data_ptr() != S0.data_ptr()


def test_bad_inputs_raise():
    q, k, v, g, beta, S0 = make_inputs(1, 4, 2, 2, 4, 4, seed=1)
    with pytest.raises(PaceError, match="v:"):
        gdn_recurrent(q, k, v[:, :, :3], g, beta)
    with pytest.raises(PaceError, match="g:"):
        gdn_chunked(q, k, v, g[:, :2], beta)
    with pytest.raises(PaceError, match="initial_state"):
        gdn_recurrent(q, k, v, g, beta, S0[:, :2])
    with pytest.raises(PaceError, match="chunk_size"):
        gdn_chunked(q, k, v, g, beta, chunk_size=0)
    with pytest.raises(PaceError, match="dtype"):
        gdn_recurrent(q, k, v, g.to(torch.int64), beta)
    with pytest.raises(PaceError, match="S_hat"):
        fold(S0[:, :, :2], DecodeBuffer(1, 2, 4, 4, 4, 2, "fp64"))


@pytest.mark.parametrize("T", [1, RECURRENT_BELOW - 1, RECURRENT_BELOW, 40])
def test_segment_is_the_recurrence_on_either_side_of_the_switch(T):
    """gdn_segment: the plain recurrence below RECURRENT_BELOW tokens, chunked from there; either way the
    float64 recurrence to float32 rounding (dots of length K through T tokens)."""
    B, H, gamma, K, V = 2, 2, 2, 16, 8
    q, k = prepare_qk(torch.randn(B, T, H, K), torch.randn(B, T, H, K))
    v, g, beta = torch.randn(B, T, H * gamma, V), -torch.rand(B, T, H * gamma), torch.rand(B, T, H * gamma)
    S0 = torch.randn(B, H * gamma, K, V)
    o, S = gdn_segment(q, k, v, g, beta, S0, chunk_size=8)
    o64, S64 = gdn_recurrent(*(x.double() for x in (q, k, v, g, beta)), initial_state=S0.double())
    assert rel(o, o64) <= fp32_bound(4 * T * K) and rel(S, S64) <= fp32_bound(4 * T * K)
