"""Dispatch: CUDA tensors go to the Triton kernels, CPU tensors to the pace_core reference.

``backend="auto"`` picks by device; ``"triton"`` forces the kernels (on CPU only under
``TRITON_INTERPRET=1``, as the tests do) and ``"reference"`` the pure-PyTorch reference.

Tolerances between the two backends (float32 inputs):

- :func:`quantize`, :func:`quantize_heads`, :func:`dequantize`: bit-identical (codes, fp16 scales, zero
  points, dequantised values).
- :func:`prefill`: bit-identical on the same device (same chunked GDN, bit-identical rounding).
- :func:`decode_step`: outputs and folded states to a relative Frobenius error below 1e-5; a stored
  integer record or requantised checkpoint entry may differ by one code (one scale step) where the
  value lies within float32 rounding of a rounding boundary (``kernels.decode_step``).
"""

from __future__ import annotations

from typing import Literal

import torch

from kernels import decode_step as _ds
from kernels import prefill as _pf
from kernels import quant_pack as _qp
from pace_core import quant
from pace_core.buffer import DecodeBuffer
from pace_core.errors import PaceError
from pace_core.recurrence import buffered_step, fold, gdn_prefill_segmented, gdn_recurrent

Backend = Literal["auto", "triton", "reference"]
BACKENDS = ("auto", "triton", "reference")
Checkpoint = torch.Tensor | quant.PackedTensor | quant.MixedPackedState


def use_kernels(device: torch.device, backend: Backend = "auto") -> bool:
    """True when the Triton kernels serve tensors on ``device`` under ``backend``."""
    if backend not in BACKENDS:
        raise PaceError(f"backend: {backend!r} not allowed; allowed: {', '.join(BACKENDS)}")
    if backend == "auto":
        return torch.device(device).type == "cuda"
    return backend == "triton"


def quantize(x: torch.Tensor, spec: quant.QuantSpec, backend: Backend = "auto") -> quant.PackedTensor:
    """Quantise and pack ``x [..., K, V]`` (see :func:`pace_core.quant.quantize`)."""
    return _qp.quantize(x, spec) if use_kernels(x.device, backend) else quant.quantize(x, spec)


def quantize_heads(S: torch.Tensor, bits_per_head: list[int], spec: quant.QuantSpec,
                   backend: Backend = "auto") -> quant.MixedPackedState:
    """Quantise ``S [..., HV, K, V]`` with per-head bit widths (see :func:`pace_core.quant.quantize_heads`)."""
    if use_kernels(S.device, backend):
        return _qp.quantize_heads(S, bits_per_head, spec)
    return quant.quantize_heads(S, bits_per_head, spec)


def dequantize(ckpt: Checkpoint, dtype: torch.dtype = torch.float32, backend: Backend = "auto") -> torch.Tensor:
    """The dequantised (or cast) checkpoint ``[..., HV, K, V]`` in ``dtype``."""
    if isinstance(ckpt, torch.Tensor):
        return ckpt.to(dtype)
    device = ckpt.codes.device if isinstance(ckpt, quant.PackedTensor) else next(iter(ckpt.parts.values())).codes.device
    if isinstance(ckpt, quant.PackedTensor):
        return _qp.dequantize(ckpt, dtype) if use_kernels(device, backend) else quant.dequantize(ckpt, dtype)
    return _qp.dequantize_heads(ckpt, dtype) if use_kernels(device, backend) else ckpt.dequantize(dtype)


def _requantize_like(ckpt: Checkpoint, S: torch.Tensor) -> Checkpoint:
    """``S`` stored the way ``ckpt`` is (reference path)."""
    if isinstance(ckpt, torch.Tensor):
        return S.to(ckpt.dtype)
    if isinstance(ckpt, quant.PackedTensor):
        return quant.quantize(S, ckpt.spec, name="state")
    bits = [0] * ckpt.shape[-3]
    for b, heads in ckpt.heads.items():
        for h in heads.tolist():
            bits[h] = b
    return quant.quantize_heads(S, bits, next(iter(ckpt.parts.values())).spec)


def decode_step(ckpt: Checkpoint, buf: DecodeBuffer, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor,
                g_t: torch.Tensor, beta_t: torch.Tensor, period: int, backend: Backend = "auto", *,
                plan: _ds.DecodePlan | None = None, check_finite: bool = True) -> tuple[torch.Tensor, Checkpoint]:
    """One buffered decode token (PACE_SPEC §3). ``ckpt`` dense ``[B, HV, K, V]`` / PackedTensor /
    MixedPackedState, ``q_t, k_t [B, H, K]`` (prepared), ``v_t [B, HV, V]``, ``g_t, beta_t [B, HV]``.

    Appends the record to ``buf``; when it holds ``period`` records, folds, requantises and clears it.
    Returns ``(o_t [B, HV, V] float32, checkpoint)``: the kernels update ``ckpt`` in place and return
    it, the reference returns a new checkpoint after a flush (else ``ckpt``). ``plan`` and
    ``check_finite`` go to :func:`kernels.decode_step.buffered_decode_step` (the reference has no
    launch plan, and its requantisation checks finiteness)."""
    if use_kernels(q_t.device, backend):
        return _ds.buffered_decode_step(ckpt, buf, q_t, k_t, v_t, g_t, beta_t, period, plan=plan,
                                        check_finite=check_finite), ckpt
    if not isinstance(period, int) or not 1 <= period <= buf.capacity:
        raise PaceError(f"period: {period!r} not allowed; allowed: an integer in 1..{buf.capacity} (buffer capacity)")
    S_hat = dequantize(ckpt, torch.float32, "reference")
    o = buffered_step(S_hat, buf, q_t, k_t, v_t, g_t, beta_t)
    if len(buf) == period:
        ckpt = _requantize_like(ckpt, fold(S_hat, buf))
        buf.clear()
    return o.to(torch.float32), ckpt


def dense_step(S: torch.Tensor, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, g_t: torch.Tensor,
               beta_t: torch.Tensor, backend: Backend = "auto") -> torch.Tensor:
    """One per-token step on a dense float32 / bfloat16 state ``S [B, HV, K, V]``, updated IN PLACE
    (the whole state read and written); ``q_t, k_t [B, H, K]`` (prepared), ``v_t [B, HV, V]``,
    ``g_t, beta_t [B, HV]``. Returns ``o_t [B, HV, V]`` float32."""
    if use_kernels(S.device, backend):
        return _ds.dense_recurrent_step(S, q_t, k_t, v_t, g_t, beta_t)
    o, S_new = gdn_recurrent(*(x[:, None].float() for x in (q_t, k_t, v_t, g_t, beta_t)), initial_state=S.float())
    S.copy_(S_new)
    return o[:, 0]


def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            initial_state: torch.Tensor | None, period: int, storage: quant.QuantSpec | torch.dtype,
            bits_per_head: list[int] | None = None, chunk_size: int = 64,
            backend: Backend = "auto") -> tuple[torch.Tensor, Checkpoint]:
    """Segmented prefill (see :func:`kernels.prefill.prefill` for shapes); returns ``(o, checkpoint)``."""
    if use_kernels(q.device, backend):
        return _pf.prefill(q, k, v, g, beta, initial_state, period, storage, bits_per_head, chunk_size)
    stored: list[Checkpoint] = []

    def round_fn(S: torch.Tensor) -> torch.Tensor:
        stored[:] = [_store_reference(S, storage, bits_per_head)]
        return dequantize(stored[0], torch.float32, "reference")

    o, S = gdn_prefill_segmented(q, k, v, g, beta, initial_state, period, round_fn, chunk_size)
    return o, stored[0] if stored else _store_reference(S, storage, bits_per_head)


def _store_reference(S: torch.Tensor, storage: quant.QuantSpec | torch.dtype,
                     bits_per_head: list[int] | None) -> Checkpoint:
    if isinstance(storage, torch.dtype):
        if bits_per_head is not None:
            raise PaceError("bits_per_head: not allowed with a dense storage dtype; allowed: None")
        return S.to(storage)
    if not isinstance(storage, quant.QuantSpec):
        raise PaceError(f"storage: {storage!r} not allowed; allowed: a QuantSpec or a torch float dtype")
    if bits_per_head is None:
        return quant.quantize(S, storage, name="state")
    return quant.quantize_heads(S, bits_per_head, storage)
