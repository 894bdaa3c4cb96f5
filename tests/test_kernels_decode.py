"""kernels.decode_step / kernels.prefill / kernels.dispatch (Triton, run by the interpreter on CPU)
against pace_core.recurrence's buffered decode and a float64 plain recurrence; GQA γ = 2 and 3;
outputs and the buffer slot being written poisoned before each launch."""

from __future__ import annotations

import copy

import pytest
import torch

from pace_core import quant
from pace_core.buffer import DecodeBuffer
from pace_core.errors import PaceError
from pace_core.recurrence import fold, gdn_recurrent, prepare_qk
from kernels_support import DEVICE, SIZES, kernel_modules

pytestmark = pytest.mark.numerics

KERNELS = kernel_modules()
ds = KERNELS["decode_step"]
dispatch = KERNELS["dispatch"]
prefill_mod = KERNELS["prefill"]

B, H, K, V, PERIOD, GROUP = (SIZES[x] for x in ("B", "H", "K", "V", "PERIOD", "GROUP"))
CONFIGS = {
    # name: (checkpoint storage, buffer precision); groups as PACE-4 (key 2g), PACE-4/8 (key g), RTN (value g)
    "fp32": (torch.float32, "fp32"),
    "bf16": (torch.bfloat16, "bf16"),
    "pace-4": (quant.QuantSpec(4, True, "key", 2 * GROUP), "int8"),
    "pace-4-8": (quant.QuantSpec(4, False, "key", GROUP), "mixed"),
    "rtn-value": (quant.QuantSpec(4, False, "value", GROUP), "int8"),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _bits(hv: int) -> list[int]:
    return [8 if h % 4 == 1 else 4 for h in range(hv)]


def _checkpoint(name: str, S: torch.Tensor, group: int | None = None):
    storage, _ = CONFIGS[name]
    if group is not None:
        storage = quant.QuantSpec(storage.bits, storage.symmetric, storage.axis, group)
    if isinstance(storage, torch.dtype):
        return S.to(storage).contiguous()
    if name == "pace-4-8":
        return quant.quantize_heads(S, _bits(S.shape[1]), storage)
    return quant.quantize(S, storage)


def _token(hv: int, v_dim: int = V):
    q, k = prepare_qk(torch.randn(B, H, K), torch.randn(B, H, K))
    return q, k, torch.randn(B, hv, v_dim), -torch.rand(B, hv) * 0.7, torch.rand(B, hv)


def _poison_slot(buf: DecodeBuffer) -> None:
    """Garbage in record slot len(buf) of every storage tensor (so an unwritten record shows)."""
    slot = len(buf)
    for store in (buf._keys, buf._values):
        for t in store.tensors:
            t[:, slot] = (0xAB if t.dtype == torch.uint8 else float("nan"))
    buf._decays[:, slot] = float("nan")


def _step(p: quant.PackedTensor) -> torch.Tensor:
    """One code step of ``p`` at every entry (its group's scale), ``[..., K, V]``."""
    one = (0x99 if p.spec.bits <= 4 else 0x81) if p.zero is None else (0x11 if p.spec.bits <= 4 else 0x01)
    return quant.dequantize(quant.PackedTensor(torch.full_like(p.codes, one), p.scale,
                                               None if p.zero is None else torch.zeros_like(p.zero),
                                               p.spec, p.shape)).abs()  # q - z = 1 everywhere


def _assert_within_one_step(got, ref) -> None:
    """Requantised checkpoints: equal except near a rounding boundary. Each side's entry is within
    half a step ``s / 2`` of the (nearly equal) folded value; with a zero point, a value at its
    group's range end may be ``s (1/2 + L 2^-11)`` away (the range's top ``(L - z) s`` misses it by
    the rounded zero point and the fp16 rounding of the scale over the ``L = 2^b - 1`` steps), so
    where the two sides' scales differ by an fp16 ulp an 8-bit entry may differ by a little more
    than one step. (Symmetric groups: ``q_max s`` misses the maximum by at most ``q_max s 2^-11``,
    less than half a step.)"""
    if isinstance(ref, torch.Tensor):
        assert _rel(got, ref) < 1e-5 if ref.dtype == torch.float32 else _rel(got, ref) < 1e-2
        return
    parts_ref = {ref.spec.bits: ref} if isinstance(ref, quant.PackedTensor) else ref.parts
    parts_got = {got.spec.bits: got} if isinstance(got, quant.PackedTensor) else got.parts
    for b, r in parts_ref.items():
        g = parts_got[b]
        d = (quant.dequantize(g) - quant.dequantize(r)).abs()
        levels = 0 if r.zero is None else (1 << b) - 1
        bound = (_step(g) + _step(r)) * (0.5 + levels * 2.0 ** -11) * 1.01 + 1e-30
        assert torch.isfinite(d).all()
        worst = int((d / bound).argmax())
        assert (d <= bound).all(), (f"{b}-bit entry {worst}: |got - ref| {d.flatten()[worst]:.4g} > bound "
                                    f"{bound.flatten()[worst]:.4g}; steps {_step(g).flatten()[worst]:.4g} / "
                                    f"{_step(r).flatten()[worst]:.4g}")
        assert (d == 0).float().mean() > 0.98


def _storage_step(precision: str, u: torch.Tensor) -> torch.Tensor:
    """An upper bound of one storage step of the buffered values ``u [B, HV, V]``: 0 in fp32, one
    bfloat16 ulp (at most ``2^-7 |u|``), or the int8 per-vector scale (``max |u| / 127``)."""
    if precision == "fp32":
        return torch.zeros_like(u)
    if precision == "int8":
        return u.abs().amax(-1, keepdim=True).expand_as(u) / 127 * 1.01
    return u.abs() * 2.0 ** -7


def _token_without_flush(ckpt, buf: DecodeBuffer, token, gamma: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run one token on copies of ``ckpt, buf`` (capacity dP + 1) with a period that keeps its record,
    kernel and reference, and check the kernel against the reference given the same stored record:
    where the kernel's ``u_t`` (float32-rounding close to the reference's) rounds to another bfloat16
    / int8 value, ``o_t`` moves by ``(k̂_t·q_t) Δû_t``, by design. Returns the kernel's ``o_t`` and that
    possible move's bound (one storage step times ``|k̂_t·q_t|``, :func:`_check_flush_token_output`)."""
    n, precision, q = len(buf), buf.precision, token[0]
    ckpt_r, buf_r, ckpt_k, buf_k = (copy.deepcopy(x) for x in (ckpt, buf, ckpt, buf))
    o_ref, _ = dispatch.decode_step(ckpt_r, buf_r, *token, PERIOD + 1, backend="reference")
    _poison_slot(buf_k)
    out = torch.full(o_ref.shape, float("nan"))
    o = ds.buffered_decode_step(ckpt_k, buf_k, *token, PERIOD + 1, out=out)
    assert o is out and torch.isfinite(o).all()
    assert len(buf_k) == len(buf_r) == n + 1
    assert torch.equal(buf_k.log_decays(), buf_r.log_decays())
    assert torch.equal(buf_k.keys(), buf_r.keys())
    got, ref = buf_k.values(), buf_r.values()
    assert torch.isfinite(got).all()
    if precision == "fp32":
        assert _rel(got, ref) < 1e-5
    else:
        assert (got == ref).float().mean() > 0.95 and _rel(got, ref) < 1e-2
    kq = torch.einsum("bhk,bhk->bh", buf_k.keys()[:, n].float(), q).repeat_interleave(gamma, dim=1)
    assert _rel(o, o_ref + kq[..., None] * (got[:, n] - ref[:, n]).float()) < 1e-5
    return o, kq[..., None].abs() * _storage_step(precision, got[:, n].float())


def _check_flush_token_output(split: bool, o_flush, o_kept, slack) -> None:
    """``o_t`` of the token run with the fold after it against the same token run without (the
    kernel's own, from :func:`_token_without_flush`): the split path runs the same step kernel, so they
    are equal; the fused kernel's folding variant sums in another order, so ``û_t`` may round the other
    way (``slack``: one storage step times ``|k̂_t·q_t|``)."""
    if split:
        assert torch.equal(o_flush, o_kept)
    else:
        assert ((o_flush - o_kept).abs() <= 1e-5 * o_kept.pow(2).mean().sqrt() + slack).all()


def _one_token(name: str, gamma: int, n: int, v_dim: int = V, group: int | None = None):
    """One token with n records buffered, value heads ``v_dim`` wide (key groups of ``group`` rows, else
    the configuration's): output and appended record (:func:`_token_without_flush`), and at n = dP - 1
    the fold + requantise. Returns the launch plan (whether it took the split path, and with which
    kernels)."""
    HV = H * gamma
    _, precision = CONFIGS[name]
    ckpt = _checkpoint(name, torch.randn(B, HV, K, v_dim) * 0.3, group)
    buf = DecodeBuffer(B, H, HV, K, v_dim, PERIOD + 1, precision, DEVICE)
    for _ in range(n):
        _, k, _, g, _ = _token(HV)
        buf.append(k, torch.randn(B, HV, v_dim) * 0.5, g)
    token = _token(HV, v_dim)
    o_kept, slack = _token_without_flush(ckpt, buf, token, gamma)
    plan = ds.plan_decode(ckpt, buf)
    split = plan.split
    ckpt_ref, buf_ref = copy.deepcopy(ckpt), copy.deepcopy(buf)
    _, ckpt_ref = dispatch.decode_step(ckpt_ref, buf_ref, *token, PERIOD, backend="reference")
    o = ds.buffered_decode_step(ckpt, buf, *token, PERIOD)
    assert len(buf) == len(buf_ref) == (0 if n == PERIOD - 1 else n + 1)
    _check_flush_token_output(split, o, o_kept, slack)
    if n == PERIOD - 1:
        _assert_within_one_step(ckpt, ckpt_ref)
    return plan


@pytest.mark.parametrize("gamma", [2, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("n", [1, PERIOD - 1])
def test_decode_step_matches_reference(name: str, gamma: int, n: int) -> None:
    """One token with n records buffered (:func:`_one_token`)."""
    _one_token(name, gamma, n)


@pytest.mark.parametrize("gamma", [2, 3])
def test_buffered_fp32_equals_plain_recurrence(gamma: int) -> None:
    """Spec §3's first test: quantisation off, fp32 buffer, any dP -> the plain recurrence (float64)."""
    HV, T = H * gamma, 5
    S0 = torch.randn(B, HV, K, V) * 0.3
    q, k = prepare_qk(torch.randn(B, T, H, K), torch.randn(B, T, H, K))
    v, g, beta = torch.randn(B, T, HV, V), -torch.rand(B, T, HV) * 0.7, torch.rand(B, T, HV)
    o_ref, S_ref = gdn_recurrent(*(x.double() for x in (q, k, v, g, beta)), initial_state=S0.double())
    ckpt, buf = S0.clone(), DecodeBuffer(B, H, HV, K, V, 2, "fp32", DEVICE)
    outs = []
    for t in range(T):
        o, ckpt = dispatch.decode_step(ckpt, buf, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], 2, backend="triton")
        outs.append(o)
    assert _rel(torch.stack(outs, 1), o_ref) < 1e-5
    assert len(buf) == T % 2
    assert _rel(fold(ckpt, buf), S_ref) < 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("gamma", [2, 3])
def test_dense_step_matches_recurrence(dtype: torch.dtype, tol: float, gamma: int) -> None:
    HV = H * gamma
    S = (torch.randn(B, HV, K, V) * 0.3).to(dtype)
    q, k, v, g, beta = _token(HV)
    o_ref, S_ref = gdn_recurrent(q[:, None].double(), k[:, None].double(), v[:, None].double(),
                                 g[:, None].double(), beta[:, None].double(), initial_state=S.double())
    out = torch.full((B, HV, V), float("nan"))
    o = ds.dense_recurrent_step(S, q, k, v, g, beta, block_v=8, out=out)
    assert o is out
    assert _rel(o, o_ref[:, 0]) < 1e-5
    assert _rel(S, S_ref) < tol
    if dtype == torch.bfloat16:  # the stored state is the fp32 result rounded to bf16: off by 1 ulp at most, rarely
        assert (S != S_ref.to(torch.bfloat16)).float().mean() < 0.02


@pytest.mark.parametrize("name,gamma", [("fp32", 2), ("pace-4", 3), ("pace-4-8", 2)])
def test_prefill_matches_reference(name: str, gamma: int) -> None:
    HV, T, P = H * gamma, SIZES["T"], SIZES["P"]
    storage, _ = CONFIGS[name]
    bits = _bits(HV) if name == "pace-4-8" else None
    S0 = torch.randn(B, HV, K, V) * 0.3
    q, k = prepare_qk(torch.randn(B, T, H, K), torch.randn(B, T, H, K))
    v, g, beta = torch.randn(B, T, HV, V), -torch.rand(B, T, HV) * 0.7, torch.rand(B, T, HV)
    args = (q, k, v, g, beta, S0, P, storage, bits, SIZES["CHUNK"])
    o_k, c_k = dispatch.prefill(*args, backend="triton")
    o_r, c_r = dispatch.prefill(*args, backend="reference")
    assert torch.equal(o_k, o_r)
    assert torch.equal(dispatch.dequantize(c_k, backend="reference"), dispatch.dequantize(c_r, backend="reference"))
    if name == "fp32":
        o64, S64 = gdn_recurrent(*(x.double() for x in (q, k, v, g, beta)), initial_state=S0.double())
        assert _rel(o_k, o64) < 1e-5 and _rel(c_k, S64) < 1e-5
    else:
        assert type(c_k) is type(c_r)
    o_empty, c_empty = prefill_mod.prefill(q[:, :0], k[:, :0], v[:, :0], g[:, :0], beta[:, :0], S0, P, storage, bits)
    assert o_empty.shape == (B, 0, HV, V)
    assert torch.equal(dispatch.dequantize(c_empty, backend="reference"),
                       dispatch.dequantize(dispatch.prefill(*(x[:, :0] for x in (q, k, v, g, beta)), S0, P, storage,
                                                            bits, backend="reference")[1], backend="reference"))


def test_bad_inputs_raise() -> None:
    HV = 2 * H
    buf = DecodeBuffer(B, H, HV, K, V, PERIOD, "int8", DEVICE)
    ckpt = _checkpoint("pace-4", torch.randn(B, HV, K, V))
    q, k, v, g, beta = _token(HV)
    with pytest.raises(PaceError, match="period"):
        ds.buffered_decode_step(ckpt, buf, q, k, v, g, beta, PERIOD + 1)
    with pytest.raises(PaceError, match="v_t"):
        ds.buffered_decode_step(ckpt, buf, q, k, v[:, :2], g, beta, PERIOD)
    with pytest.raises(PaceError, match="fp64"):
        ds.buffered_decode_step(ckpt, DecodeBuffer(B, H, HV, K, V, PERIOD, "fp64", DEVICE), q, k, v, g, beta, PERIOD)
    with pytest.raises(PaceError, match="out"):
        ds.buffered_decode_step(ckpt, buf, q, k, v, g, beta, PERIOD, out=torch.empty(B, HV, V, dtype=torch.float64))
    with pytest.raises(PaceError, match="storage"):
        prefill_mod.prefill(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], None, 4, "int4")


@pytest.mark.parametrize("name,gamma", [("pace-4", 2), ("pace-4-8", 3)])
def test_packed_key_axis_split_path_over_two_periods(name: str, gamma: int) -> None:
    """Packed key-axis checkpoints take the split path (dots and record kernels, then a separate flush
    kernel). Two whole periods, every token against the reference run from the kernel's own
    checkpoint and buffer (a low-precision buffer would otherwise let one-ulp differences of earlier
    records add up; :func:`_token_without_flush`), and each period's flush against the reference's
    fold + requantisation."""
    HV = H * gamma
    _, precision = CONFIGS[name]
    ckpt = _checkpoint(name, torch.randn(B, HV, K, V) * 0.3)
    buf = DecodeBuffer(B, H, HV, K, V, PERIOD + 1, precision, DEVICE)
    assert ds.plan_decode(ckpt, buf).split
    for _ in range(2):
        start = quant.dequantize(_as_packed(ckpt))
        for _ in range(PERIOD):
            token = _token(HV)
            o_kept, slack = _token_without_flush(ckpt, buf, token, gamma)
            ref_buf = copy.deepcopy(buf)
            _, ref_ckpt = dispatch.decode_step(copy.deepcopy(ckpt), ref_buf, *token, PERIOD, backend="reference")
            _poison_slot(buf)
            o = ds.buffered_decode_step(ckpt, buf, *token, PERIOD)
            _check_flush_token_output(True, o, o_kept, slack)
            assert len(buf) == len(ref_buf)
        assert len(buf) == 0
        _assert_within_one_step(ckpt, ref_ckpt)
        assert not torch.equal(quant.dequantize(_as_packed(ckpt)), start)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("name,gamma", [("pace-4", 2), ("pace-4-8", 3)])
def test_split_path_on_half_tiles(name: str, gamma: int, fused: bool, monkeypatch) -> None:
    """Heads at least 32 values wide, so that the dots kernel takes 4-bit codes as even / odd half
    tiles of 16 or more columns (narrower heads pad them) and the step may run as one kernel
    (``fused``) or as the dots and record kernels: a period's last token, its output and the fold +
    requantisation against the reference."""
    monkeypatch.setitem(ds.SPLIT_DEFAULTS, "fused_step", fused)
    plan = _one_token(name, gamma, PERIOD - 1, max(V, 32))
    assert plan.split and plan.meta["fusable"] and plan.meta["fused_step"] == fused


@pytest.mark.parametrize("name", ["pace-4", "pace-4-8"])
def test_split_path_on_small_groups(name: str) -> None:
    """Key groups of 8 rows, so that a flush tile of 16 key rows holds two groups."""
    assert _one_token(name, 2, PERIOD - 1, group=8).split


def test_narrow_keys_are_refused() -> None:
    """Keys narrower than a tensor-core tile (K = 8) are refused by the decode kernels (the flush gave
    wrong PACE-4/8 checkpoints there on the H200), with a message naming the limit."""
    ckpt = _checkpoint("pace-4", torch.randn(B, H, 8, V), group=8)
    with pytest.raises(PaceError, match="K >= 16"):
        ds.plan_decode(ckpt, DecodeBuffer(B, H, H, 8, V, PERIOD, "int8", DEVICE))
    with pytest.raises(PaceError, match="K >= 16"):
        ds.plan_decode(torch.zeros(B, H, 8, V), DecodeBuffer(B, H, H, 8, V, PERIOD, "fp32", DEVICE))


def _as_packed(ckpt):
    return ckpt if isinstance(ckpt, quant.PackedTensor) else ckpt.parts[4]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_dispatch_dense_step_backends_agree(dtype: torch.dtype, tol: float) -> None:
    HV = 2 * H
    S = (torch.randn(B, HV, K, V) * 0.3).to(dtype)
    S_k, S_r = S.clone(), S.clone()
    q, k, v, g, beta = _token(HV)
    o_k = dispatch.dense_step(S_k, q, k, v, g, beta, backend="triton")
    o_r = dispatch.dense_step(S_r, q, k, v, g, beta, backend="reference")
    assert _rel(o_k, o_r) < 1e-5
    assert S_k.dtype == S_r.dtype == dtype and _rel(S_k, S_r) < tol and not torch.equal(S_k, S)
