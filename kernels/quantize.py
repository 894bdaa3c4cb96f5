"""Triton quantise + pack and unpack + dequantise of recurrent states in pace_core.quant's storage
format (PACE_SPEC §2), with per-head bit widths (PACE-4/8) in one launch.

Results are bit-identical to :mod:`pace_core.quant` (codes, fp16 scales, zero points and the dequantised
values) for float32 / bfloat16 / float16 input (:mod:`kernels.primitives`). Kernel limits (the reference
has none): ``K``, ``V`` and the group size are powers of two, ``V >= 2``; float64 input is not accepted
here (its reference works in float64).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pace_core import quant
from pace_core.deferred import defer
from pace_core.errors import PaceError

from .plan import CkptArgs, PartStorage, bits_of_heads, check_kernel_shape, head_table, part_layout, row_block
from .primitives import ckpt_store, ckpt_tile, packed_head, store_as


@triton.jit
def _quant_kernel(x_ptr, part_ptr, slot_ptr, c0_ptr, s0_ptr, z0_ptr, c1_ptr, s1_ptr, z1_ptr, HV, HV0, HV1,
                  K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, G: tl.constexpr,
                  KEY_AXIS: tl.constexpr, SYM: tl.constexpr,
                  BITS0: tl.constexpr, PZ0: tl.constexpr, CC0: tl.constexpr, SS0: tl.constexpr, ZS0: tl.constexpr,
                  BITS1: tl.constexpr, PZ1: tl.constexpr, CC1: tl.constexpr, SS1: tl.constexpr, ZS1: tl.constexpr,
                  TWO: tl.constexpr):
    """Rows ``[r0, r0 + BK)`` of state ``n`` (``x [N, K, V]``, ``N = B HV``) quantised into its head's part."""
    n = tl.program_id(0).to(tl.int64)
    r0 = tl.program_id(1) * BK
    _, _, _, part, a0, as0, az0, a1, as1, az1, _ = packed_head(  # no key heads here: H = HV
        n, HV, HV, part_ptr, slot_ptr, c0_ptr, s0_ptr, z0_ptr, c1_ptr, s1_ptr, z1_ptr, HV0, HV1, K, CC0, SS0, ZS0, CC1,
        SS1, ZS1, TWO, False)
    rows = r0 + tl.arange(0, BK)
    x = tl.load(x_ptr + n * K * V + rows[:, None] * V + tl.arange(0, V)[None, :]).to(tl.float32)
    ckpt_store(x, x_ptr, part, a0, as0, az0, a1, as1, az1, r0, 0, BK, V, K, V, G, KEY_AXIS, SYM, BITS0, PZ0, BITS1,
               PZ1, TWO, False)


@triton.jit
def _dequant_kernel(out_ptr, part_ptr, slot_ptr, c0_ptr, s0_ptr, z0_ptr, c1_ptr, s1_ptr, z1_ptr, HV, HV0, HV1,
                    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, G: tl.constexpr,
                    KEY_AXIS: tl.constexpr, SYM: tl.constexpr,
                    BITS0: tl.constexpr, PZ0: tl.constexpr, CC0: tl.constexpr, SS0: tl.constexpr, ZS0: tl.constexpr,
                    BITS1: tl.constexpr, PZ1: tl.constexpr, CC1: tl.constexpr, SS1: tl.constexpr, ZS1: tl.constexpr,
                    TWO: tl.constexpr):
    """Rows ``[r0, r0 + BK)`` of state ``n`` dequantised from its head's part into ``out [N, K, V]``."""
    n = tl.program_id(0).to(tl.int64)
    r0 = tl.program_id(1) * BK
    _, _, _, part, a0, as0, az0, a1, as1, az1, _ = packed_head(  # no key heads here: H = HV
        n, HV, HV, part_ptr, slot_ptr, c0_ptr, s0_ptr, z0_ptr, c1_ptr, s1_ptr, z1_ptr, HV0, HV1, K, CC0, SS0, ZS0, CC1,
        SS1, ZS1, TWO, False)
    rows = r0 + tl.arange(0, BK)
    x = ckpt_tile(out_ptr, part, a0, as0, az0, a1, as1, az1, r0, 0, BK, V, K, V, G, KEY_AXIS, SYM, BITS0, PZ0, BITS1,
                  PZ1, TWO, False)
    store_as(out_ptr + n * K * V + rows[:, None] * V + tl.arange(0, V)[None, :], x)


def _check_state(S: torch.Tensor, name: str) -> None:
    if not isinstance(S, torch.Tensor) or S.dim() < 3 or S.shape[-3] == 0:
        raise PaceError(f"{name}: must be a tensor [..., HV, K, V] with at least one value head; got shape "
                        f"{tuple(getattr(S, 'shape', ()))}")
    if S.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise PaceError(f"{name}: dtype {S.dtype} not supported by the kernels; allowed: float32, bfloat16, float16")


def _check_values(S: torch.Tensor, spec: quant.QuantSpec, bits_per_head: list[int], name: str) -> None:
    """PaceError like pace_core.quant's where ``S`` holds NaN or inf, or where a group's fp16 scale would
    overflow (the kernels would saturate it): one reduction (and one device read) decides, since the
    largest magnitude is NaN or inf when any value is; only then is the state counted, or quantised by the
    reference to name the group. Recorded instead while checks are deferred (:mod:`pace_core.deferred`)."""
    if not S.numel():
        return
    peak = S.abs().amax()
    if defer(lambda: ~(peak <= overflow_free(spec, bits_per_head))):  # NaN fails the comparison too
        return
    largest = float(peak)
    if not math.isfinite(largest):
        quant.check_finite(S, name)
    if largest > overflow_free(spec, bits_per_head):
        quant.quantize_heads(S, bits_per_head, spec, name=name)


def overflow_free(spec: quant.QuantSpec, bits_per_head: list[int]) -> float:
    """The largest magnitude a state may hold with no group's fp16 scale overflowing: a group's scale is at
    most its max ``|x|`` (symmetric) or its range, at most twice that (with a zero point), over the
    narrowest width's ``q_max``."""
    qmax = min((1 << (b - 1)) - 1 if spec.symmetric else (1 << b) - 1 for b in set(bits_per_head))
    return quant.FP16_MAX * qmax / (1 if spec.symmetric else 2)


def empty_part(lead: tuple[int, ...], hv: int, K: int, V: int, spec: quant.QuantSpec,
                device: torch.device) -> quant.PackedTensor:
    """Uninitialised storage of one part (filled by a kernel)."""
    lay = part_layout(spec, K, V)
    sshape = quant.scale_shape((K, V), spec)
    codes = torch.empty(*lead, hv, K, lay.code_cols, dtype=torch.uint8, device=device)
    scale = torch.empty(*lead, hv, *sshape, dtype=torch.float16, device=device)
    zero = None
    if not spec.symmetric:
        zshape = (sshape[0], quant.packed_last_dim(spec.bits, sshape[1]))
        zero = torch.empty(*lead, hv, *zshape, dtype=torch.uint8, device=device)
    return quant.PackedTensor(codes, scale, zero, spec, (*lead, hv, K, V))


def _check_same_layout(out: quant.MixedPackedState, parts: list[quant.PackedTensor], widths: list[int]) -> None:
    if sorted(out.parts) != widths:
        raise PaceError(f"out: bit widths {sorted(out.parts)} not allowed; allowed: {widths}")
    for b, p in zip(widths, parts):
        o = out.parts[b]
        for name, a, r in (("codes", o.codes, p.codes), ("scale", o.scale, p.scale), ("zero", o.zero, p.zero)):
            if (a is None) != (r is None) or (a is not None and (a.shape != r.shape or a.dtype != r.dtype
                                                                 or not a.is_contiguous())):
                raise PaceError(f"out: {b}-bit {name} layout not allowed; allowed: contiguous like the result")


def quantize_heads(S: torch.Tensor, bits_per_head: list[int], spec: quant.QuantSpec, *,
                   name: str = "state", out: quant.MixedPackedState | None = None) -> quant.MixedPackedState:
    """One launch: quantise ``S [..., HV, K, V]`` with head ``h`` at ``bits_per_head[h]`` bits (at most two
    distinct widths; the rest of ``spec``). Bit-identical to :func:`pace_core.quant.quantize_heads`.
    ``out``: storage to write into (same layout as the result; reused, e.g. under CUDA graphs)."""
    _check_state(S, name)
    *lead, HV, K, V = S.shape
    bits_per_head = quant.check_head_bits(bits_per_head, HV)
    check_kernel_shape(K, V, spec, name, widths=tuple(bits_per_head))
    _check_values(S, spec, bits_per_head, name)
    widths, table = head_table(bits_per_head, S.device)
    specs = [quant.QuantSpec(b, spec.symmetric, spec.axis, spec.group_size) for b in widths]
    parts = [empty_part(tuple(lead), len(table.heads[b]), K, V, s, S.device) for b, s in zip(widths, specs)]
    if out is not None:
        _check_same_layout(out, parts, widths)
        parts = [out.parts[b] for b in widths]
    x = S.contiguous()
    N = x.numel() // (K * V)
    BK = row_block(K, spec, V)
    hv1 = len(table.heads[widths[1]]) if len(widths) == 2 else 0
    ckpt = CkptArgs.of_parts(table.part, table.slot, [PartStorage.of(p, K, V) for p in parts],
                             (len(table.heads[widths[0]]), hv1))
    if N:
        _quant_kernel[(N, K // BK)](x, *ckpt.pointers(), HV, *ckpt.heads, K=K, V=V, BK=BK, G=spec.group_size,
                                    KEY_AXIS=spec.axis == "key", SYM=spec.symmetric, **ckpt.constexprs())
    return quant.MixedPackedState(dict(zip(widths, parts)), table.heads, tuple(S.shape))


def dequantize_heads(m: quant.MixedPackedState, dtype: torch.dtype = torch.float32,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """One launch: the dequantised state ``[..., HV, K, V]`` of ``m`` in ``dtype`` (float32, bfloat16 or
    float16). Bit-identical to ``m.dequantize(dtype)``. ``out``: a contiguous tensor of that shape and
    dtype to write into."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise PaceError(f"dtype: {dtype} not supported by the kernels; allowed: float32, bfloat16, float16")
    widths = sorted(m.parts)
    if len(widths) > 2:
        raise PaceError(f"parts: {widths} distinct widths not supported in one launch; allowed: at most 2")
    *lead, HV, K, V = m.shape
    bits_per_head = bits_of_heads({b: m.heads[b] for b in widths}, HV)
    parts = [m.parts[b] for b in widths]
    spec = parts[0].spec
    check_kernel_shape(K, V, spec, "state", widths=tuple(widths))
    device = parts[0].codes.device
    _, table = head_table(bits_per_head, device)
    if out is None:
        out = torch.empty(m.shape, dtype=dtype, device=device)
    elif tuple(out.shape) != tuple(m.shape) or out.dtype != dtype or not out.is_contiguous():
        raise PaceError(f"out: {tuple(out.shape)} {out.dtype} not allowed; allowed: contiguous {m.shape} {dtype}")
    N = out.numel() // (K * V)
    BK = row_block(K, spec, V)
    hv1 = len(table.heads[widths[1]]) if len(widths) == 2 else 0
    storage = [PartStorage(p.codes.contiguous(), p.scale.contiguous(),
                           (p.scale if p.zero is None else p.zero).contiguous(), part_layout(p.spec, K, V))
               for p in parts]
    ckpt = CkptArgs.of_parts(table.part, table.slot, storage, (len(table.heads[widths[0]]), hv1))
    if N:
        _dequant_kernel[(N, K // BK)](out, *ckpt.pointers(), HV, *ckpt.heads, K=K, V=V, BK=BK, G=spec.group_size,
                                      KEY_AXIS=spec.axis == "key", SYM=spec.symmetric, **ckpt.constexprs())
    return out


def quantize(x: torch.Tensor, spec: quant.QuantSpec, *, name: str = "x") -> quant.PackedTensor:
    """Quantise and pack ``x [..., K, V]`` (float32/bfloat16/float16). Bit-identical to
    :func:`pace_core.quant.quantize`."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise PaceError(f"{name}: must be a tensor [..., K, V]; got shape {tuple(getattr(x, 'shape', ()))}")
    m = quantize_heads(x.reshape(math.prod(x.shape[:-2]), 1, *x.shape[-2:]), [spec.bits], spec, name=name)
    p = m.parts[spec.bits]
    lead = tuple(x.shape[:-2])
    return quant.PackedTensor(
        p.codes.reshape(*lead, *p.codes.shape[-2:]), p.scale.reshape(*lead, *p.scale.shape[-2:]),
        None if p.zero is None else p.zero.reshape(*lead, *p.zero.shape[-2:]), spec, tuple(x.shape),
    )


def dequantize(p: quant.PackedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantised ``[..., K, V]`` of ``p`` in ``dtype``. Bit-identical to :func:`pace_core.quant.dequantize`."""
    *lead, K, V = p.shape
    n = 1
    for d in lead:
        n *= d
    flat = quant.PackedTensor(
        p.codes.reshape(n, 1, *p.codes.shape[-2:]), p.scale.reshape(n, 1, *p.scale.shape[-2:]),
        None if p.zero is None else p.zero.reshape(n, 1, *p.zero.shape[-2:]), p.spec, (n, 1, K, V),
    )
    heads = head_table([p.spec.bits], p.codes.device)[1].heads  # the kept map of one head: no device read
    out = dequantize_heads(quant.MixedPackedState({p.spec.bits: flat}, heads, (n, 1, K, V)), dtype)
    return out.reshape(p.shape)
