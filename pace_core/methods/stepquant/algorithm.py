"""STEPQuant (arXiv 2609.38169; public code ``Dreamer-Toby/STEPQuant``): its state format, its fit, its
calibration quantities and its bit allocation, as pure tensor functions (no model code).

Marks: **[issue]** the algorithm as issue 38 states it; **[repo]** a fact read in the public repository
where the issue is silent or differs; **[ours]** a choice of this project.

**Format.** A GDN value head h of a state ``S [..., HV, K, V]`` has one width for the whole head: an
integer width b in {2, 4, 6, 8} or :data:`PIVOT` (16: the raw values in fp16, no scales) **[issue]**.
An integer head stores ``x̂[k, v] = r[k] · c[v] · z[k, v]`` with codes ``z`` in ``[-q, q]``,
``q = 2^(b-1) - 1`` (4, 6, 8 bits), one fp16 row scale per key row and one fp16 column scale per value
column. 2 bits **[repo]**: levels ``z`` in {-3, -1, 1, 3} (``z = sign(y) · (3 if |y| >= 2 else 1)`` with
``y = x / (r c)`` and ``sign(0) = +1``: a tie at ``|y| = 2`` goes to 3), and the row scale is one per group
of :data:`TWO_BIT_GROUP` = 32 consecutive values of a row, ``r[k, g]`` (no per-row scale: the repository's
kernels store only the group scales; its Python codec also keeps an unused per-row scale, not counted here).

**Fit** of one integer head **[issue]**, ``w [K]`` its impact weights (:func:`impact_weights`):
1. ``r[k] = fp16(√(mean_v |x[k, v]| / w[k]))`` (2 bits: the mean over the row's 32-value group);
2. ``c⁰[v] = fp16(max_k |x[k, v] / r[k]| / q)``; codes ``z⁰`` of ``x / (r c⁰)``;
3. one weighted least-squares refit ``c[v] = fp16(Σ_k w[k]² r[k] z⁰ x / Σ_k w[k]² r[k]² z⁰²)`` (``r`` the
   row's or the group's scale), kept at ``c⁰`` where the denominator is 0; final codes ``z`` of ``x / (r c)``.
Codes round half to even (4..8 bits) and saturate at ±q. Scales are fp16 of a float32 ratio, clamped into
``[2^-24, 65504]`` **[issue, repo]** (2^-24: fp16's smallest subnormal, not quant's 2^-14). **[ours]**: a scale
of an all-zero row, group or column is 0 (the repository clamps it to 2^-24, so that its 2-bit heads, which
have no zero level, dequantise an all-zero group to ``2^-24 · c``): every all-zero input dequantises to
exactly 0, never NaN. Non-finite input is a PaceError. A row scale beyond 65504 is clamped (the column scale absorbs
it); a first column scale ``c⁰`` beyond 65504 would saturate codes and is a PaceError naming the head and
column (|x| up to about ``65504 · r · q`` is representable); a pivot value beyond ±65504 is a PaceError.
Arithmetic runs in the working dtype of :func:`pace_core.quant.work_dtype` (float64 for float64 input,
else float32; the repository fits in float32); codes divide by the exact product ``r · c`` of the stored
scales (the repository divides by r, then by c); dequantised values are
``z · (r · c)``, one rounding in float32 (``r · c`` is exact there), the same function on both paths.

**Storage** (:class:`StepQuantState`), per width b the heads of that width: codes packed densely along V,
little-endian, by the project's one packing (:func:`pace_core.quant.pack_codes`): 2-bit four per byte, 4-bit two
per byte, 6-bit four per three bytes, 8-bit one per byte; stored codes are ``(z + 3) / 2`` (2 bits) or
``z + 2^(b-1)``. Row scales fp16 ``[..., n_b, K]`` (2 bits ``[..., n_b, K, V/32]``), column scales fp16
``[..., n_b, V]``, pivots fp16 ``[..., n_16, K, V]``, the head map one int16 per value head (once per layer, as
quant.MixedPackedState). Exact bytes: :func:`stepquant_nbytes`; bits per state value beside the paper's nominal 4 / 6:
:func:`resident_bits`.

**Calibration** (per GDN layer; q, k prepared as in ``pace_core.model.patch.core_inputs``):
- impact ``ω[h, k] = mean_t (α_t (q_t − β_t k_t (k_tᵀ q_t)))[k]²`` with ``α_t = exp(g_t)`` the decay and the
  key head ``h // (HV / H)`` (:func:`impact_omega`); ``w = ω^(γ/2)`` normalised to geometric mean 1 over
  the head's K rows, γ = 0.25, ω floored at 1e-20 first **[repo]** (:func:`impact_weights`). ω averages
  over all calibration tokens: the mean of several segments is their token-weighted mean.
- lifetime ``L_h = Σ_{τ<T} e^{2 ḡ_h τ}``, ḡ_h the mean log decay ``g`` of the head, T = 2048
  (:func:`lifetime_weights`).
- cost ``C_h(b) = L_h · mean over snapshots and over the K·V values of w[k]² (x̂ − x)²`` with every head
  at width b (:func:`cost_table`; the mean over values, not a sum, is the repository's: one factor for
  all heads of a model, so the allocation is the same). **[repo]** snapshots: the state every 8 tokens,
  64 kept per layer by a seeded reservoir, of 32 WikiText-2 train segments of 2048 tokens. **[ours]** The method
  calibrates on PACE's shared samples by default (the calibration text's first 2,048 tokens, a state every 64
  tokens) and on this protocol with ``stepquant_calibration`` "authors" (:data:`pace_core.methods.stepquant.AUTHORS`),
  both on WikiText-2 *valid* (train is not in the shared corpus).

**Allocation** over all GDN heads of all layers (:func:`allocate`): an exact multiple-choice knapsack
(:func:`knapsack`) minimises ``Σ C_h(b_h)`` under ``Σ b_h <= N·n`` (N heads, n = 4 or 6); the P heads with
the largest cost at that allocation (``C_h(b_h)``, the repository's "allocated residual risk"; ties to the
lower index) become pivots; the knapsack again on the other heads with the budget ``N·n − 8·P``: a pivot is
charged 8 bits of the nominal budget **[issue, repo]** ("counts each FP16 pivot as INT8"), though it
stores 16 bits per value plus nothing else. P is the paper's 32 of 2304 heads (Qwen3.x-27B, 48 GDN
layers × 48 value heads) at the same share, ``P = round(N / 72)``, halves up **[ours]** (:func:`pivot_count`,
:func:`default_pivots`; the repository's default is 32 for any GDN model); a parameter.

**Schedule** (the method's, not this module's; the quantiser is stateless, its widths and ``w`` fixed per
layer by the calibration): decode rounds after every token, the token's output read from the unrounded state
(PACE's dP = 1 without a buffer); prefill rounds once at the prompt's end (the repository's HF adapter: one
rounding per forward call) or once per P-token segment (a setting). Each rounding is
``quantize_with_values(S, widths, w)`` of the layer's state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction

import numpy as np
import torch

from pace_core.deferred import defer
from pace_core.errors import PaceError
from pace_core.quant import (
    FP16_MAX,
    check_finite,
    div_by_int,
    fp16_scale,
    heads_at,
    pack_codes,
    safe_divisor,
    unpack_codes,
    work_dtype,
)

PIVOT = 16
"""The width of a pivot head: raw fp16 values."""
INTEGER_WIDTHS = (2, 4, 6, 8)
WIDTHS = (*INTEGER_WIDTHS, PIVOT)
CANDIDATES: dict[int, tuple[int, ...]] = {4: (2, 4, 6, 8), 6: (4, 6, 8)}
"""Candidate integer widths per nominal width (stepquant-4, stepquant-6)."""
GAMMA = 0.25
HORIZON = 2048
TWO_BIT_GROUP = 32
SCALE_FLOOR = 2.0**-24
OMEGA_FLOOR = 1e-20
PIVOT_CHARGE = 8
"""Bits of the nominal budget a pivot head takes."""
PAPER_PIVOTS, PAPER_HEADS = 32, 48 * 48
SCALE_BITS = 16


def qmax(bits: int) -> int:
    """Largest code magnitude of an integer width: 3 at 2 bits (levels ±1, ±3), else ``2^(b-1) - 1``."""
    return 3 if bits == 2 else 2 ** (bits - 1) - 1


# ---------------------------------------------------------------- input checks


def check_widths(widths: Sequence[int] | torch.Tensor, hv: int | None = None, field: str = "widths") -> tuple[int, ...]:
    """The per-head widths as a tuple; PaceError unless each is one of 2, 4, 6, 8, 16 and (given ``hv``) there is
    one per value head."""
    if isinstance(widths, torch.Tensor):
        if widths.is_floating_point() or widths.is_complex() or widths.dtype == torch.bool:
            raise PaceError(f"{field} must hold integers; allowed: one of {WIDTHS} per value head")
        widths = widths.flatten().tolist()
    values = list(widths)
    for b in values:
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or int(b) not in WIDTHS:
            raise PaceError(f"{field} holds {b!r}; allowed: {', '.join(map(str, WIDTHS))} (16 = fp16 pivot head)")
    if hv is not None and len(values) != hv:
        raise PaceError(f"{field} has {len(values)} entries; allowed: one per value head ({hv})")
    return tuple(int(b) for b in values)


def _check_state(S: torch.Tensor, name: str) -> None:
    if not isinstance(S, torch.Tensor) or not S.is_floating_point() or S.dim() < 3:
        raise PaceError(f"{name} must be a floating-point tensor [..., HV, K, V]; got {type(S).__name__} "
                        f"{getattr(S, 'dtype', '')} {tuple(getattr(S, 'shape', ()))}")
    check_finite(S, name)


def _check_weights(w: torch.Tensor, hv: int, k: int) -> torch.Tensor:
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or tuple(w.shape) != (hv, k):
        raise PaceError(f"w must be a float tensor [HV, K] = [{hv}, {k}] of impact weights; got "
                        f"{getattr(w, 'dtype', type(w).__name__)} {tuple(getattr(w, 'shape', ()))}")
    check_finite(w, "w")
    if not defer(lambda: w <= 0) and bool((w <= 0).any()):
        raise PaceError("w holds weights <= 0; allowed: positive impact weights (impact_weights gives them)")
    return w


def _check_value_dim(widths: tuple[int, ...], v: int) -> None:
    if any(b in (2, 6) for b in widths) and v % 4:
        raise PaceError(f"V={v} does not pack 2- or 6-bit codes (four per byte / three bytes); allowed: V a "
                        "multiple of 4, or no 2- or 6-bit heads")
    if 2 in widths and v % TWO_BIT_GROUP:
        raise PaceError(f"V={v} does not split into 2-bit row groups of {TWO_BIT_GROUP}; allowed: V a multiple "
                        f"of {TWO_BIT_GROUP}, or no 2-bit heads")


def _where(lead: Sequence[int], at: Sequence[int]) -> str:
    """'sequence i, ' for a [B, ...] state, 'index (...), ' for other leading dims, '' for none."""
    if not lead:
        return ""
    return f"sequence {at[0]}, " if len(lead) == 1 else f"index {tuple(at)}, "


def _stored(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned stored codes of signed codes z: ``(z + 3) / 2`` at 2 bits, else ``z + 2^(b-1)``."""
    return ((z + 3) / 2 if bits == 2 else z + 2 ** (bits - 1)).to(torch.uint8)


def _signed(u: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Signed codes of stored codes (inverse of :func:`_stored`), in ``dtype``."""
    u = u.to(dtype)
    return 2 * u - 3 if bits == 2 else u - 2 ** (bits - 1)


# ---------------------------------------------------------------- the fit


def _full_rows(rows: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Row scales broadcast against ``[..., n, K, V]``: ``[..., n, K, 1]``, 2 bits ``[..., n, K, V]``."""
    r = rows.to(dtype)
    return r.repeat_interleave(TWO_BIT_GROUP, -1) if bits == 2 else r.unsqueeze(-1)


def _codes(x: torch.Tensor, r: torch.Tensor, c: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed codes of ``x [..., n, K, V]`` (working dtype) for full row scales ``r`` and fp16 column scales
    ``c [..., n, V]``: nearest level of ``y = x / (r c)`` (a zero step divides 0 by 1)."""
    y = x / safe_divisor(r * c.to(x.dtype).unsqueeze(-2), x.dtype)
    if bits == 2:
        sign = torch.where(y >= 0, 1.0, -1.0).to(x.dtype)
        return sign * torch.where(y.abs() >= 2, 3.0, 1.0).to(x.dtype)
    return torch.round(y).clamp_(-qmax(bits), qmax(bits))


def _values(z: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Dequantised values ``z · (r · c)`` [..., n, K, V] in ``dtype``, computed in its working dtype (``r · c``
    exact there): the one formula of quantise-with-values and dequantise."""
    wd = work_dtype(dtype)
    return (z.to(wd) * (_full_rows(rows, bits, wd) * cols.to(wd).unsqueeze(-2))).to(dtype)


def _fit(x: torch.Tensor, w: torch.Tensor, bits: int, heads: Sequence[int], name: str
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fit of integer width ``bits`` for ``x [..., n, K, V]`` (working dtype) with weights ``w [n, K]``
    (same dtype); ``heads``: the value heads the n heads are (for errors). Returns (signed codes
    [..., n, K, V] in x's dtype, row scales fp16 [..., n, K] or [..., n, K, V/32], column scales fp16 [..., n, V])."""
    ax = x.abs()
    if bits == 2:
        m = ax.unflatten(-1, (-1, TWO_BIT_GROUP)).mean(-1)
        ratio = torch.sqrt(m / w.unsqueeze(-1))
    else:
        m = ax.mean(-1)
        ratio = torch.sqrt(m / w)
    rows = fp16_scale(ratio.float(), m > 0, SCALE_FLOOR)
    r = _full_rows(rows, bits, x.dtype)
    amax = (ax / safe_divisor(r, x.dtype)).amax(-2)
    first = div_by_int(amax.float(), qmax(bits))
    over = first > FP16_MAX
    if not defer(lambda: over) and bool(over.any()):
        at = [int(i) for i in torch.nonzero(over)[0]]
        raise PaceError(
            f"{name}: a column scale overflows fp16 ({_where(x.shape[:-3], at[:-2])}value head {heads[at[-2]]}, "
            f"value column {at[-1]}): |x / r| up to {float(amax[tuple(at)]):.4g} needs {float(first[tuple(at)]):.4g} "
            f"> 65504 at {bits} bits; allowed: |x| up to about 65504 · r · {qmax(bits)} (another width, a pivot "
            "head, or inputs that keep the state in range)")
    c0 = fp16_scale(first, amax > 0, SCALE_FLOOR)
    z0 = _codes(x, r, c0, bits)
    weighted = w.square().unsqueeze(-1) * r * z0
    num = (weighted * x).sum(-2)
    den = (weighted * r * z0).sum(-2)
    refit = fp16_scale((num / torch.where(den > 0, den, 1.0)).float(), num > 0, SCALE_FLOOR)
    c = torch.where(den > 0, refit, c0)
    return _codes(x, r, c, bits), rows, c


# ---------------------------------------------------------------- the stored state


@dataclass
class StepQuantState:
    """A STEPQuant state ``[..., HV, K, V]`` as stored (module docstring: the format).

    Per integer width b present: ``codes[b]`` uint8 [..., n_b, K, V·b/8], ``row_scale[b]`` fp16 [..., n_b, K]
    (b = 2: [..., n_2, K, V/32]), ``col_scale[b]`` fp16 [..., n_b, V]; ``pivots`` fp16 [..., n_16, K, V] or
    None; ``heads[b]`` int16, the ascending value heads of width b (16: the pivots), kept once for the batch.
    """

    codes: dict[int, torch.Tensor]
    row_scale: dict[int, torch.Tensor]
    col_scale: dict[int, torch.Tensor]
    pivots: torch.Tensor | None
    heads: dict[int, torch.Tensor]
    shape: tuple[int, ...]

    @property
    def widths(self) -> tuple[int, ...]:
        """The width of each value head (16: pivot)."""
        out = [0] * self.shape[-3]
        for b, idx in self.heads.items():
            for h in idx.tolist():
                out[h] = b
        return tuple(out)

    def map_nbytes(self) -> int:
        """Real bytes of the head map (one int16 per value head)."""
        return sum(h.numel() * h.element_size() for h in self.heads.values())

    def nbytes(self) -> int:
        """Real bytes of codes, row and column scales, pivots and the head map."""
        return sum(self.split_bytes())

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by name (``codes@<b>``, ``row_scale@<b>``, ``col_scale@<b>``, ``pivots``), batch axis
        first (the head map is kept once)."""
        out = {f"{name}@{b}": t for name, d in (("codes", self.codes), ("row_scale", self.row_scale),
                                                 ("col_scale", self.col_scale)) for b, t in d.items()}
        return out if self.pivots is None else {**out, "pivots": self.pivots}

    def with_stored(self, tensors: dict[str, torch.Tensor]) -> StepQuantState:
        """This structure (and head map) holding ``tensors`` (named as :meth:`stored_tensors`)."""
        pick = lambda name: {b: tensors[f"{name}@{b}"] for b in getattr(self, name)}  # noqa: E731
        n = next(iter(tensors.values())).shape[0]
        return replace(self, codes=pick("codes"), row_scale=pick("row_scale"), col_scale=pick("col_scale"),
                       pivots=tensors.get("pivots"), shape=(n, *self.shape[1:]))

    def split_bytes(self) -> tuple[int, int]:
        """``(payload, metadata)`` bytes: codes and pivots; row and column scales and the head map."""
        size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        payload = size(self.codes.values()) + (0 if self.pivots is None else size([self.pivots]))
        return payload, size(self.row_scale.values()) + size(self.col_scale.values()) + self.map_nbytes()


def _quantize(S: torch.Tensor, widths: Sequence[int] | torch.Tensor, w: torch.Tensor, name: str,
              dtype: torch.dtype | None) -> tuple[StepQuantState, torch.Tensor | None]:
    _check_state(S, name)
    hv, k, v = S.shape[-3:]
    widths = check_widths(widths, hv)
    w = _check_weights(w, hv, k)
    _check_value_dim(widths, v)
    wd = work_dtype(S.dtype)
    codes, rows, cols, heads, pivots = {}, {}, {}, {}, None
    out = None if dtype is None else torch.empty(S.shape, dtype=dtype, device=S.device)
    for b in sorted(set(widths)):
        ids = [h for h in range(hv) if widths[h] == b]
        idx = heads_at(widths, b, S.device)
        heads[b] = idx.to(torch.int16)
        x = S.index_select(S.dim() - 3, idx)
        if b == PIVOT:
            big = x.abs().amax((-2, -1)) > FP16_MAX
            if not defer(lambda big=big: big) and bool(big.any()):
                at = [int(i) for i in torch.nonzero(big)[0]]
                raise PaceError(f"{name}: a value overflows fp16 in a pivot head ({_where(S.shape[:-3], at[:-1])}value "
                                f"head {ids[at[-1]]}): |x| up to {float(x.abs().amax((-2, -1))[tuple(at)]):.4g} > "
                                "65504; allowed: values within fp16's range (an integer width, or inputs that keep "
                                "the state in range)")
            pivots = x.to(torch.float16)
            values = None if out is None else pivots.to(dtype)
        else:
            z, rows[b], cols[b] = _fit(x.to(wd), w.index_select(0, idx.to(w.device)).to(device=S.device, dtype=wd),
                                       b, ids, name)
            codes[b] = pack_codes(_stored(z, b), b, checked=True)
            values = None if out is None else _values(z, rows[b], cols[b], b, dtype)
        if out is not None:
            out.index_copy_(S.dim() - 3, idx, values)
    return StepQuantState(codes, rows, cols, pivots, heads, tuple(S.shape)), out


def quantize(S: torch.Tensor, widths: Sequence[int] | torch.Tensor, w: torch.Tensor, *,
             name: str = "state") -> StepQuantState:
    """Quantise ``S [..., HV, K, V]`` (any float dtype and device) with head h at ``widths[h]`` (2, 4, 6, 8, or
    16 = fp16 pivot) and impact weights ``w [HV, K]`` (positive; :func:`impact_weights`). ``name`` names S in
    errors."""
    return _quantize(S, widths, w, name, None)[0]


def quantize_with_values(
    S: torch.Tensor,
    widths: Sequence[int] | torch.Tensor,
    w: torch.Tensor,
    *,
    name: str = "state",
    dtype: torch.dtype = torch.float32,
) -> tuple[StepQuantState, torch.Tensor]:
    """:func:`quantize` and the dequantised state ``[..., HV, K, V]`` in ``dtype`` at once (bit-identical to
    :func:`dequantize` of it: the same values function on the same codes and scales)."""
    return _quantize(S, widths, w, name, dtype)


def dequantize(p: StepQuantState, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantised state ``[..., HV, K, V]`` in ``dtype``: ``z · (r · c)`` for integer heads, the fp16 values
    of pivot heads."""
    device = next(iter(p.heads.values())).device
    out = torch.empty(p.shape, dtype=dtype, device=device)
    v = p.shape[-1]
    for b, idx in p.heads.items():
        if b == PIVOT:
            values = p.pivots.to(dtype)
        else:
            z = _signed(unpack_codes(p.codes[b], b, v), b, work_dtype(dtype))
            values = _values(z, p.row_scale[b], p.col_scale[b], b, dtype)
        out.index_copy_(len(p.shape) - 3, idx.long(), values)
    return out


def _head_nbytes(bits: int, k: int, v: int) -> int:
    """Stored bytes of one head of one sequence: codes, row and column scales, or the fp16 pivot."""
    if bits == PIVOT:
        return 2 * k * v
    rows = k * v // TWO_BIT_GROUP if bits == 2 else k
    return k * v * bits // 8 + 2 * rows + 2 * v


def stepquant_nbytes(shape: Sequence[int], widths: Sequence[int] | torch.Tensor) -> int:
    """Bytes that :func:`quantize` stores for a state of ``shape [..., HV, K, V]`` with these per-head widths
    (codes, scales, pivots of every sequence, and the head map once)."""
    *lead, hv, k, v = shape
    widths = check_widths(widths, hv)
    _check_value_dim(widths, v)
    return math.prod(lead) * sum(_head_nbytes(b, k, v) for b in widths) + 2 * hv


@dataclass(frozen=True)
class StepQuantBits:
    """Bits per state value of an allocation, averaged over its heads (exact fractions): code_bits +
    row_scale_bits + column_scale_bits + pivot_bits = resident_bits, the real storage of one sequence
    (:func:`stepquant_nbytes` without the head map, which is kept once per layer); nominal_bits is the paper's
    budget measure, the mean width with a pivot counted as :data:`PIVOT_CHARGE` bits."""

    code_bits: Fraction
    row_scale_bits: Fraction
    column_scale_bits: Fraction
    pivot_bits: Fraction
    resident_bits: Fraction
    nominal_bits: Fraction


def resident_bits(widths: Sequence[int] | torch.Tensor, k: int, v: int) -> StepQuantBits:
    """:class:`StepQuantBits` of the widths of all GDN heads (any shape, e.g. ``[L, HV]``), heads ``[K, V]``."""
    widths = check_widths(widths)
    if not widths:
        raise PaceError("widths is empty; allowed: the width of at least one head")
    _check_value_dim(widths, v)
    n, values = len(widths), Fraction(k * v)
    ints = [b for b in widths if b != PIVOT]
    codes = Fraction(sum(ints), n)
    rows = Fraction(SCALE_BITS * sum(k * v // TWO_BIT_GROUP if b == 2 else k for b in ints), n) / values
    cols = Fraction(SCALE_BITS * v * len(ints), n) / values
    pivots = Fraction(PIVOT * (n - len(ints)), n)
    nominal = Fraction(sum(ints) + PIVOT_CHARGE * (n - len(ints)), n)
    return StepQuantBits(codes, rows, cols, pivots, codes + rows + cols + pivots, nominal)


# ---------------------------------------------------------------- calibration quantities


def impact_omega(q: torch.Tensor, k: torch.Tensor, beta: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """``ω[h, k] = mean_t (α_t (q_t − β_t k_t (k_tᵀ q_t)))[k]²`` [HV, K] float64, q and k of key head
    ``h // (HV / H)``.

    q, k [T, H, K]: prepared as ``pace_core.model.patch.core_inputs`` gives them (L2-normalised, q scaled by
    ``K^-1/2``, as the repository's calibration sees them; the scale cancels in :func:`impact_weights` except
    through the floor of rows with ω = 0); beta [T, HV]; alpha [T, HV] the decays ``exp(g)`` in [0, 1]."""
    for t, label in ((q, "q"), (k, "k"), (beta, "beta"), (alpha, "alpha")):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise PaceError(f"{label} must be a float tensor; got {type(t).__name__}")
    if (
        q.dim() != 3
        or q.shape != k.shape
        or beta.dim() != 2
        or alpha.shape != beta.shape
        or beta.shape[0] != q.shape[0]
    ):
        raise PaceError(f"q, k must be [T, H, K] and beta, alpha [T, HV] with the same T; got q {tuple(q.shape)}, "
                        f"k {tuple(k.shape)}, beta {tuple(beta.shape)}, alpha {tuple(alpha.shape)}")
    t_len, h, _ = q.shape
    hv = beta.shape[1]
    if t_len == 0 or hv % h:
        raise PaceError(f"T={t_len}, H={h}, HV={hv}; allowed: T >= 1 and HV a multiple of H")
    for t, label in ((q, "q"), (k, "k"), (beta, "beta"), (alpha, "alpha")):
        check_finite(t, label)
    if bool(((alpha < 0) | (alpha > 1)).any()):
        raise PaceError("alpha holds decays outside [0, 1]; allowed: alpha = exp(g) with g <= 0")
    group = hv // h
    qh = q.double().repeat_interleave(group, 1)
    kh = k.double().repeat_interleave(group, 1)
    b, a = beta.double().unsqueeze(-1), alpha.double().unsqueeze(-1)
    read = a * (qh - b * kh * (kh * qh).sum(-1, keepdim=True))
    return read.square().mean(0)


def impact_weights(omega: torch.Tensor, gamma: float = GAMMA) -> torch.Tensor:
    """``w = max(ω, 1e-20)^(γ/2)`` normalised to geometric mean 1 along the last (key) axis: ``omega [..., K]``
    (>= 0, e.g. [HV, K] of :func:`impact_omega`) -> w [..., K] float64."""
    if not isinstance(omega, torch.Tensor) or not omega.is_floating_point() or omega.dim() < 1 or omega.shape[-1] == 0:
        raise PaceError(f"omega must be a float tensor [..., K]; got {tuple(getattr(omega, 'shape', ()))}")
    check_finite(omega, "omega")
    if bool((omega < 0).any()):
        raise PaceError("omega holds negative values; allowed: omega >= 0 (a mean of squares)")
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 < gamma < math.inf:
        raise PaceError(f"gamma={gamma!r} is not allowed; allowed: a positive number (the paper's {GAMMA})")
    log_w = omega.double().clamp_min(OMEGA_FLOOR).log() * (gamma / 2)
    return (log_w - log_w.mean(-1, keepdim=True)).exp()


def lifetime_weights(mean_log_decay: torch.Tensor, horizon: int = HORIZON) -> torch.Tensor:
    """``L = Σ_{τ<T} e^{2 ḡ τ}`` = ``expm1(2ḡT) / expm1(2ḡ)`` (T where ḡ = 0), float64, of mean log decays
    ``ḡ <= 0`` of any shape (per head: ``g.mean(0)`` of the log decays ``g [T, HV]``)."""
    if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1:
        raise PaceError(f"horizon={horizon!r} is not allowed; allowed: an integer >= 1 (the paper's {HORIZON})")
    if not isinstance(mean_log_decay, torch.Tensor) or not mean_log_decay.is_floating_point():
        raise PaceError("mean_log_decay must be a float tensor of mean log decays")
    check_finite(mean_log_decay, "mean_log_decay")
    if bool((mean_log_decay > 0).any()):
        raise PaceError("mean_log_decay holds positive values; allowed: mean log decays <= 0")
    x = 2 * mean_log_decay.double()
    safe = torch.where(x == 0, -1.0, x)
    return torch.where(x == 0, float(horizon), torch.expm1(horizon * safe) / torch.expm1(safe))


def cost_table(snapshots: torch.Tensor, w: torch.Tensor, lifetime: torch.Tensor,
               candidates: Sequence[int]) -> torch.Tensor:
    """``C[h, j] = lifetime[h] · mean over snapshots, rows and columns of w[h, k]² (x̂ − x)²`` with every head at
    width ``candidates[j]`` [HV, C] float64.

    snapshots [N, HV, K, V] calibration states of one layer (any float dtype; the fit runs in its working
    dtype); w [HV, K] impact weights; lifetime [HV] (:func:`lifetime_weights`); candidates integer widths."""
    _check_state(snapshots, "snapshots")
    if snapshots.dim() != 4 or snapshots.shape[0] == 0:
        raise PaceError(f"snapshots must be [N, HV, K, V] with N >= 1; got {tuple(snapshots.shape)}")
    n, hv, k, v = snapshots.shape
    w = _check_weights(w, hv, k)
    cands = _check_candidates(candidates)
    _check_value_dim(cands, v)
    if not isinstance(lifetime, torch.Tensor) or tuple(lifetime.shape) != (hv,):
        raise PaceError(f"lifetime must be a tensor [HV] = [{hv}]; got {tuple(getattr(lifetime, 'shape', ()))}")
    check_finite(lifetime, "lifetime")
    wd = work_dtype(snapshots.dtype)
    wk = w.to(device=snapshots.device, dtype=wd)
    w2 = w.to(snapshots.device).double().square().unsqueeze(-1)
    chunk = max(1, (1 << 21) // (hv * k * v))
    heads = list(range(hv))
    total = torch.zeros(hv, len(cands), dtype=torch.float64, device=snapshots.device)
    for start in range(0, n, chunk):
        x = snapshots[start:start + chunk].to(wd)
        for j, b in enumerate(cands):
            z, rows, cols = _fit(x, wk, b, heads, "snapshots")
            err = (_values(z, rows, cols, b, wd) - x).double().square()
            total[:, j] += (err * w2).sum((0, -2, -1))
    return (total / (n * k * v) * lifetime.double().to(total.device).unsqueeze(-1)).cpu()


# ---------------------------------------------------------------- allocation


def _check_candidates(candidates: Sequence[int]) -> tuple[int, ...]:
    cands = tuple(candidates)
    if not cands or len(set(cands)) != len(cands) or any(
            isinstance(b, bool) or not isinstance(b, (int, np.integer)) or int(b) not in INTEGER_WIDTHS for b in cands):
        raise PaceError(f"candidates={cands!r} is not allowed; allowed: distinct widths of {INTEGER_WIDTHS}, e.g. "
                        f"{CANDIDATES[4]} (stepquant-4) or {CANDIDATES[6]} (stepquant-6)")
    return tuple(int(b) for b in cands)


def _cost_array(cost: torch.Tensor | np.ndarray, n_candidates: int) -> np.ndarray:
    c = np.asarray(cost.detach().cpu() if isinstance(cost, torch.Tensor) else cost, dtype=np.float64)
    if c.ndim < 1 or c.shape[-1] != n_candidates:
        raise PaceError(f"cost has shape {c.shape}; allowed: [..., {n_candidates}] (one column per candidate width)")
    if not np.isfinite(c).all():
        raise PaceError("cost holds NaN or inf; allowed: finite costs")
    return c


def knapsack(cost: torch.Tensor | np.ndarray, candidates: Sequence[int], budget: int) -> torch.Tensor:
    """The exact multiple-choice knapsack: widths [N] int64 (each from ``candidates``) minimising
    ``Σ_h cost[h, j_h]`` subject to ``Σ_h width_h <= budget``. cost [N, C] float (finite).

    Dynamic programming over integer budgets in units of ``gcd(candidates)``: ``best[u]`` is the least cost of
    the heads so far using exactly u units, summed head by head in float64 (float addition is monotone, so the
    minimum is exactly the least of those sums over all assignments). Ties: the narrower candidate, then the
    smaller total. PaceError when even the narrowest widths exceed the budget."""
    cands = _check_candidates(candidates)
    c = _cost_array(cost, len(cands))
    if c.ndim != 2:
        raise PaceError(f"cost has shape {c.shape}; allowed: [N, {len(cands)}]")
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
        raise PaceError(f"budget={budget!r} is not allowed; allowed: an integer number of bits")
    n = c.shape[0]
    if budget < n * min(cands):
        raise PaceError(f"budget={budget} bits is below {n} heads at {min(cands)} bits ({n * min(cands)}); allowed: "
                        "a budget of at least N · the narrowest candidate")
    unit = math.gcd(*cands)
    units = [b // unit for b in cands]
    cap = min(int(budget) // unit, n * max(units))
    best = np.full(cap + 1, np.inf)
    best[0] = 0.0
    back = np.full((n, cap + 1), -1, dtype=np.int8)
    for i in range(n):
        nxt = np.full(cap + 1, np.inf)
        for j, u in enumerate(units):
            if u > cap:  # wider than the whole budget
                continue
            trial = best[:cap + 1 - u] + c[i, j]
            better = trial < nxt[u:]
            nxt[u:][better] = trial[better]
            back[i, u:][better] = j
        best = nxt
    used = int(np.argmin(best))
    picks = np.empty(n, dtype=np.int64)
    for i in range(n - 1, -1, -1):
        j = int(back[i, used])
        picks[i] = cands[j]
        used -= units[j]
    return torch.from_numpy(picks)


def pivot_count(share: float | Fraction, n_heads: int) -> int:
    """The pivot heads of a ``share`` of ``n_heads`` GDN heads: ``share · n`` rounded to the nearest whole head,
    halves up (1/72 of 36 heads: 1; of 35: 0). A float share is read as the nearest fraction of denominator at most
    10^6 (1/72 exactly, not its binary neighbour), so a half is a half."""
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 0:
        raise PaceError(f"n_heads={n_heads!r} is not allowed; allowed: an integer >= 0")
    exact = share if isinstance(share, Fraction) else Fraction(share).limit_denominator(10**6)
    if not 0 <= exact <= 1:
        raise PaceError(f"share={share!r} is not allowed; allowed: a share of the heads in [0, 1]")
    return math.floor(exact * n_heads + Fraction(1, 2))


def default_pivots(n_heads: int) -> int:
    """The paper's share of pivot heads, 32 of 2304, for a model of ``n_heads`` GDN heads: ``round(n / 72)``,
    halves up (:func:`pivot_count`)."""
    return pivot_count(Fraction(PAPER_PIVOTS, PAPER_HEADS), n_heads)


def allocate(cost: torch.Tensor | np.ndarray, nominal_bits: int, pivots: int,
             candidates: Sequence[int] | None = None) -> torch.Tensor:
    """STEPQuant's widths for all GDN heads: cost [..., C] (e.g. [L, HV, C] of :func:`cost_table` per layer,
    stacked), the nominal width n (4 or 6: ``candidates`` default to :data:`CANDIDATES`\\[n]) and the pivot count
    P. Returns widths [...] int64, 16 for a pivot head.

    The knapsack under ``N·n`` bits; the P heads of largest cost at that allocation (stable: ties to the lower
    flat index) become pivots; the knapsack again on the others under ``N·n − 8·P`` bits."""
    if candidates is None:
        if nominal_bits not in CANDIDATES:
            raise PaceError(f"nominal_bits={nominal_bits!r} has no default candidates; allowed: 4, 6, or candidates")
        candidates = CANDIDATES[nominal_bits]
    cands = _check_candidates(candidates)
    c = _cost_array(cost, len(cands))
    shape = c.shape[:-1]
    flat = c.reshape(-1, len(cands))
    n = flat.shape[0]
    if isinstance(nominal_bits, bool) or not isinstance(nominal_bits, int) or nominal_bits < 1:
        raise PaceError(f"nominal_bits={nominal_bits!r} is not allowed; allowed: a positive integer (4 or 6)")
    if isinstance(pivots, bool) or not isinstance(pivots, int) or not 0 <= pivots <= n:
        raise PaceError(f"pivots={pivots!r} is not allowed; allowed: integers 0..{n} (the number of heads)")
    budget = nominal_bits * n
    rest_budget = budget - PIVOT_CHARGE * pivots
    if rest_budget < (n - pivots) * min(cands):
        feasible = [p for p in range(n + 1) if budget - PIVOT_CHARGE * p >= (n - p) * min(cands)]
        allowed = f"at most {max(feasible)} pivots" if feasible else f"nominal_bits >= {min(cands)}"
        raise PaceError(f"nominal_bits={nominal_bits} with pivots={pivots} leaves {rest_budget} bits for {n - pivots} "
                        f"heads, below {min(cands)} bits each; allowed: {allowed} for {n} heads")
    first = knapsack(flat, cands, budget).numpy()
    risk = flat[np.arange(n), [cands.index(int(b)) for b in first]]
    mask = np.zeros(n, dtype=bool)
    mask[np.argsort(-risk, kind="stable")[:pivots]] = True
    widths = np.full(n, PIVOT, dtype=np.int64)
    if pivots < n:
        widths[~mask] = knapsack(flat[~mask], cands, rest_budget).numpy()
    return torch.from_numpy(widths).reshape(shape)
