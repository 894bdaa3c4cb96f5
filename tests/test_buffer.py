"""Tests of pace_core.buffer: storage precisions, byte counts, and decode error per precision."""

import pytest
import torch
from references import periodic_decode

from pace_core.buffer import PRECISIONS, DecodeBuffer, record_bytes
from pace_core.errors import PaceError
from pace_core.recurrence import gdn_recurrent, prepare_qk

pytestmark = pytest.mark.numerics


def filled(precision, B=2, H=2, HV=6, K=16, V=8, n=3, capacity=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    buf = DecodeBuffer(B, H, HV, K, V, capacity, precision)
    ks = torch.randn(B, n, H, K, generator=gen) * torch.logspace(-2, 2, H)[None, None, :, None]
    us = torch.randn(B, n, HV, V, generator=gen) * 3
    gs = -torch.rand(B, n, HV, generator=gen)
    for i in range(n):
        buf.append(ks[:, i], us[:, i], gs[:, i])
    return buf, ks, us, gs


def check_vector_quant(x, x_hat, bits):
    """x_hat is a symmetric per-vector quantisation of x [..., n] with an fp16 scale
    fp16(amax / qmax) (kept in fp16's normal range, as pace_core.quant documents): codes are
    integers in [-qmax, qmax] and the error is at most scale / 2."""
    qmax = 2 ** (bits - 1) - 1
    amax = x.double().abs().amax(-1, keepdim=True)
    scale = (amax / qmax).clamp(2.0**-14, 65504).to(torch.float16).double()
    codes = x_hat.double() / scale
    assert torch.equal(codes, codes.round())
    assert float(codes.abs().max()) == qmax
    assert bool(((x_hat.double() - x.double()).abs() <= scale / 2 * (1 + 1e-6)).all())


@pytest.mark.parametrize("precision", ["fp32", "fp64"])
def test_full_precision_round_trip(precision):
    buf, ks, us, gs = filled(precision)
    dtype = torch.float64 if precision == "fp64" else torch.float32
    assert len(buf) == 3 and buf.dtype == dtype
    assert torch.equal(buf.keys(), ks.to(dtype)) and torch.equal(buf.values(), us.to(dtype))
    assert torch.equal(buf.log_decays(), gs.to(dtype))


def test_bf16_storage():
    buf, ks, us, gs = filled("bf16")
    assert torch.equal(buf.keys(), ks.bfloat16().float())
    assert torch.equal(buf.values(), us.bfloat16().float())
    assert torch.equal(buf.log_decays(), gs)  # log decays stay fp32
    rel = (buf.values() - us).abs() / us.abs()
    assert float(rel.max()) <= 2.0**-8  # bf16 unit roundoff


def test_int8_storage_per_vector_scales():
    buf, ks, us, gs = filled("int8")
    check_vector_quant(ks, buf.keys(), 8)
    check_vector_quant(us, buf.values(), 8)
    assert torch.equal(buf.log_decays(), gs)
    # per-vector scales: the 1e-3-scaled key head keeps its relative precision
    small = (buf.keys()[:, :, 0] - ks[:, :, 0]).abs().max() / ks[:, :, 0].abs().max()
    assert float(small) <= 1 / 254 * (1 + 1e-3)


def test_mixed_storage():
    buf, ks, us, gs = filled("mixed")
    check_vector_quant(ks, buf.keys(), 4)
    assert torch.equal(buf.values(), us.bfloat16().float())
    assert torch.equal(buf.log_decays(), gs)


def test_zero_vector_stays_zero():
    buf = DecodeBuffer(1, 1, 2, 8, 4, 2, "int8")
    buf.append(torch.zeros(1, 1, 8), torch.zeros(1, 2, 4), torch.zeros(1, 2))
    assert torch.equal(buf.keys(), torch.zeros(1, 1, 1, 8)) and torch.equal(buf.values(), torch.zeros(1, 1, 2, 4))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_byte_counts(precision):
    B, H, HV, K, V, cap = 2, 2, 6, 16, 8, 4
    buf, *_ = filled(precision, B, H, HV, K, V, n=3, capacity=cap)
    # spec §5: c = (b_k d_k / γ + b_v d_v + 32) / (d_k d_v) per state value per buffered token
    b_k, b_v, b_g = {"fp32": (32, 32, 32), "bf16": (16, 16, 32), "int8": (8, 8, 32),
                     "mixed": (4, 16, 32), "fp64": (64, 64, 64)}[precision]
    gamma = HV // H
    c = (b_k * K / gamma + b_v * V + b_g) / (K * V)
    scales = {"int8": 2 * (H + HV), "mixed": 2 * H}.get(precision, 0)
    per_record = HV * c * K * V / 8 + scales
    assert record_bytes(precision, H, HV, K, V) == per_record
    storage = buf.storage()
    assert buf.nbytes_allocated() == sum(t.numel() * t.element_size() for t in storage.values())
    assert buf.nbytes_allocated() == B * cap * per_record
    assert buf.nbytes() == B * 3 * per_record
    buf.clear()
    assert len(buf) == 0 and buf.nbytes() == 0 and buf.nbytes_allocated() == B * cap * per_record


def test_packed_codes_are_real():
    """4-bit keys take half a byte per entry in storage."""
    buf = DecodeBuffer(1, 2, 4, 128, 128, 8, "mixed")
    storage = buf.storage()
    assert storage["keys"].dtype == torch.uint8 and storage["keys"].shape == (1, 8, 2, 64)
    assert storage["key_scale"].dtype == torch.float16 and storage["values"].dtype == torch.bfloat16
    assert "value_scale" not in storage


def test_mark_appended_and_storage_are_live():
    buf, ks, us, gs = filled("fp32", n=1, capacity=3)
    storage = buf.storage()
    storage["keys"][:, 1] = ks[:, 0] * 2
    storage["values"][:, 1] = us[:, 0] * 2
    storage["log_decays"][:, 1] = gs[:, 0] * 2
    buf.mark_appended()
    assert len(buf) == 2
    assert torch.equal(buf.keys()[:, 1], ks[:, 0] * 2) and torch.equal(buf.log_decays()[:, 1], gs[:, 0] * 2)
    with pytest.raises(PaceError, match="n:"):
        buf.mark_appended(2)


def test_reorder_rows():
    buf, ks, us, gs = filled("int8", B=3)
    before_k, before_u = buf.keys(), buf.values()
    buf.reorder(torch.tensor([2, 0, 0]))
    assert torch.equal(buf.keys(), before_k[[2, 0, 0]]) and torch.equal(buf.values(), before_u[[2, 0, 0]])
    assert torch.equal(buf.log_decays(), gs[[2, 0, 0]])
    with pytest.raises(PaceError, match="beam_idx"):
        buf.reorder(torch.tensor([0, 1]))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_extend_and_rounded_are_appends(precision):
    """extend(n records) stores what n appends store (every vector is quantised on its own), and rounded()
    gives the values a record reads back, without storing it."""
    one, ks, us, gs = filled(precision, n=3)
    many = DecodeBuffer(2, 2, 6, 16, 8, 4, precision)
    many.extend(ks[:, :2], us[:, :2], gs[:, :2])
    many.extend(ks[:, 2:], us[:, 2:], gs[:, 2:])
    assert len(many) == 3
    for a, b in zip(one.storage().values(), many.storage().values()):
        assert torch.equal(a, b)
    assert torch.equal(many.keys(), one.keys()) and torch.equal(many.values(), one.values())
    assert torch.equal(many.rounded("key", ks), one.keys()) and torch.equal(many.rounded("value", us), one.values())
    assert len(many) == 3
    with pytest.raises(PaceError, match="capacity=4 .3 held, 2 more"):
        many.extend(ks[:, :2], us[:, :2], gs[:, :2])
    with pytest.raises(PaceError, match="k: shape"):
        many.extend(ks[:, 0], us[:, :1], gs[:, :1])


def test_bad_input_raises():
    with pytest.raises(PaceError, match="precision.*fp32, bf16, int8, mixed"):
        DecodeBuffer(1, 1, 1, 4, 4, 2, "int4")
    with pytest.raises(PaceError, match="num_v_heads"):
        DecodeBuffer(1, 2, 3, 4, 4, 2, "fp32")
    with pytest.raises(PaceError, match="capacity"):
        DecodeBuffer(1, 1, 1, 4, 4, 0, "fp32")
    buf = DecodeBuffer(1, 1, 2, 4, 4, 1, "int8")
    with pytest.raises(PaceError, match="u:"):
        buf.append(torch.ones(1, 1, 4), torch.ones(1, 1, 4), torch.zeros(1, 2))
    with pytest.raises(PaceError, match="non-finite"):
        buf.append(torch.ones(1, 1, 4), torch.full((1, 2, 4), float("nan")), torch.zeros(1, 2))
    buf.append(torch.ones(1, 1, 4), torch.ones(1, 2, 4), torch.zeros(1, 2))
    with pytest.raises(PaceError, match="capacity=1"):
        buf.append(torch.ones(1, 1, 4), torch.ones(1, 2, 4), torch.zeros(1, 2))


def test_decode_error_per_precision():
    """Buffered decode (no state rounding) with each buffer precision against the fp64 recurrence:
    fp32 is exact to fp32 rounding; bf16 (unit roundoff 2^-8) and int8 (step amax/127 per vector)
    stay within ~1e-2; mixed is the coarsest, as its 4-bit keys (step amax/7, for unit keys of
    K = 32 an rms error of ~0.09 relative) are, but bounded."""
    gen = torch.Generator().manual_seed(77)
    B, T, H, gamma, K, V, dP = 2, 24, 2, 2, 32, 32, 8
    HV = H * gamma
    q, k = prepare_qk(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64),
                      torch.randn(B, T, H, K, generator=gen, dtype=torch.float64))
    v = torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64)
    g = (0.9 + 0.099 * torch.rand(B, T, HV, generator=gen, dtype=torch.float64)).log()
    beta = torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    S0 = torch.randn(B, HV, K, V, generator=gen, dtype=torch.float64) * 0.3
    o_ref, S_ref = gdn_recurrent(q, k, v, g, beta, S0)
    errors = {}
    for precision in ("fp32", "bf16", "int8", "mixed"):
        o, S, _ = periodic_decode(q, k, v, g, beta, S0, dP, lambda s: s, precision)
        errors[precision] = float((o - o_ref).norm() / o_ref.norm())
    assert errors["fp32"] < 1e-6
    assert 1e-5 < errors["bf16"] < 5e-3
    assert 1e-5 < errors["int8"] < 2e-2
    assert max(errors["bf16"], errors["int8"]) < errors["mixed"] < 0.2
