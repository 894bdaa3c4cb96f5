"""The quantised recurrent state of a model (spec §2–§4): per GDN layer the packed checkpoint, the
per-head bit widths and the decode buffer, with prefill in P-token segments and buffered decode
with a flush every dP tokens.

Per method (``cfg.method``) the checkpoint of a layer (``[B, HV, K, V]``) is stored as

- ``none``: the plain tensor in ``cfg.reference_dtype`` (float32 or bfloat16); its "rounding" is
  that cast (none at all for float32), applied where a quantised method rounds: at each
  prefill-segment end and at each decode flush (so float32 with dP > 1 is "quantisation off,
  buffering on");
- ``rtn`` / ``pace``: :func:`pace_core.quant.quantize` (a ``PackedTensor``) with
  ``QuantSpec(cfg.bits, cfg.symmetric, cfg.group_axis, cfg.group_size)``, or, when some heads are
  promoted, :func:`pace_core.quant.quantize_heads` (a ``MixedPackedState``): the heads of
  ``cfg.high_heads[i]`` (i = the layer's position among the GDN layers) at ``cfg.high_bits``, the
  rest at ``cfg.bits`` (:meth:`PaceConfig.head_bits`; ``high_share > 0`` needs ``high_heads``);
- ``dsq``: :func:`pace_core.outliers.dsq_quantize` at ``cfg.bits``;
- ``damp``: :class:`pace_core.outliers.DampQuantizer` with the layer's calibrated outlier rows
  (``damp_rows``, ``[HV, cfg.damp_outlier_rows]`` per GDN layer, e.g. from
  :func:`pace_core.outliers.rank_outlier_rows`), ``cfg.bits``, ``cfg.damp_hadamard``, value-axis
  groups of ``cfg.group_size``.

Decode with ``cfg.decode_period`` dP = 1 is per-token rounding and keeps no buffer; dP >= 2 uses a
:class:`~pace_core.buffer.DecodeBuffer` of dP records in ``cfg.buffer`` precision (every method).

A layer's tensors live on the construction ``device`` until its first tokens arrive; if those are
on another device (``device_map="auto"``), the still-empty layer is re-created there. Later tokens
must come on that device.

Bytes (:meth:`StateStore.layer_nbytes`), all counted from the stored tensors: ``payload`` = the
tensors that hold state values (codes; DAMP's fp16 outlier rows; the plain tensor of ``none``),
``metadata`` = scales, zero points, DSQ row/column scales, DAMP row indices; ``buffer`` = the
decode buffer's allocated storage for dP records (the memory it holds; 0 at dP = 1). Note the
naming: the store's ``payload`` / ``metadata`` bytes are the stored codes and their scales, i.e.
:class:`pace_core.accounting.ResidentBits`'s ``code_bits`` and ``scale_bits`` (plus DAMP's row
indices), whose ``payload_bits`` is their sum, the seeds' "payload".

A prefill that follows decode tokens (``cfg.prefill_after_decode`` **[ours]**: the spec does not say
how rounding periods continue across prefill calls): ``flush`` first flushes the partial buffer (one
extra rounding at a point that need not be a multiple of dP); ``carry`` runs the prompt from the
exact state, the checkpoint plus the folded buffer, without rounding it. Either way the buffer is
empty afterwards and the P-token segments count from the start of that prefill call.

All batch rows step together (as in HF ``generate``). Computation is float32.

Kernels: buffered decode (dP >= 2) of the methods ``none`` (float32 / bfloat16), ``rtn`` and ``pace``
(:func:`kernels.dispatch.decode_step`), and per-token decode (dP = 1) of method ``none``
(:func:`kernels.dispatch.dense_step`), run on the Triton kernels of ``kernels/`` when the layer's
tensors are on a CUDA device and the kernels support the shapes (powers of two); everything else,
and every CPU tensor, runs the pure-PyTorch reference here. ``backend`` (or the environment variable
``PACE_KERNELS``): ``auto`` (the default), ``reference`` (never the kernels, e.g. to compare) or
``triton`` (always where supported; on a CPU only under ``TRITON_INTERPRET=1``, as the tests do).
The kernels match the reference to float32 rounding (``kernels.dispatch`` states the tolerances).
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, Sequence, Union

import torch

from pace_core import quant
from pace_core.buffer import DecodeBuffer
from pace_core.errors import PaceError
from pace_core.outliers import DampQuantizer, DampTensor, DSQTensor, dsq_dequantize, dsq_quantize
from pace_core.recurrence import buffered_step, fold, gdn_prefill_segmented, gdn_recurrent

if TYPE_CHECKING:
    from pace_core.config import PaceConfig
    from pace_core.shapes import ModelShape

Checkpoint = Union[torch.Tensor, quant.PackedTensor, quant.MixedPackedState, DSQTensor, DampTensor]
KERNELS_ENV = "PACE_KERNELS"
KERNEL_BACKENDS = ("auto", "reference", "triton")


def default_backend() -> str:
    """The decode backend from ``$PACE_KERNELS`` (``auto`` when unset); PaceError for another value."""
    backend = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if backend not in KERNEL_BACKENDS:
        raise PaceError(f"{KERNELS_ENV}={backend!r} not allowed; allowed: {', '.join(KERNEL_BACKENDS)}")
    return backend


def _nb(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def checkpoint_bytes(c: Checkpoint) -> tuple[int, int]:
    """``(payload, metadata)`` real bytes of a stored checkpoint (see the module docstring)."""
    if isinstance(c, torch.Tensor):
        return _nb(c), 0
    if isinstance(c, quant.PackedTensor):
        return _nb(c.codes), _nb(c.scale) + _nb(c.zero)
    if isinstance(c, quant.MixedPackedState):
        parts = [checkpoint_bytes(p) for p in c.parts.values()]
        return sum(p for p, _ in parts), sum(m for _, m in parts)
    if isinstance(c, DSQTensor):
        return _nb(c.codes), _nb(c.row_scale) + _nb(c.col_scale)
    if isinstance(c, DampTensor):
        payload, metadata = checkpoint_bytes(c.rest)
        return payload + _nb(c.outliers), metadata + _nb(c.rows)
    raise PaceError(
        f"checkpoint: type {type(c).__name__} not allowed; allowed: Tensor, PackedTensor, MixedPackedState, "
        "DSQTensor, DampTensor"
    )


def _reorder(c: Checkpoint, index: torch.Tensor) -> Checkpoint:
    """The checkpoint with batch row ``b`` taken from old row ``index[b]``."""
    if isinstance(c, torch.Tensor):
        return c.index_select(0, index)
    if isinstance(c, quant.PackedTensor):
        zero = None if c.zero is None else c.zero.index_select(0, index)
        return replace(c, codes=c.codes.index_select(0, index), scale=c.scale.index_select(0, index), zero=zero)
    if isinstance(c, quant.MixedPackedState):
        return replace(c, parts={b: _reorder(p, index) for b, p in c.parts.items()})
    if isinstance(c, DSQTensor):
        return replace(c, codes=c.codes.index_select(0, index), row_scale=c.row_scale.index_select(0, index),
                       col_scale=c.col_scale.index_select(0, index))
    return replace(c, outliers=c.outliers.index_select(0, index), rest=_reorder(c.rest, index))


class LayerState:
    """One GDN layer's state for ``batch`` sequences: checkpoint, per-head bits, decode buffer.

    ``gdn_index``: the layer's position among the GDN layers (selects ``cfg.high_heads``);
    ``damp_rows`` ``[HV, r]`` outlier rows (damp only); ``name`` is used in error messages.
    """

    def __init__(
        self,
        cfg: PaceConfig,
        batch: int,
        num_k_heads: int,
        num_v_heads: int,
        d_k: int,
        d_v: int,
        device: torch.device | str,
        gdn_index: int = 0,
        damp_rows: torch.Tensor | None = None,
        name: str = "state",
        chunk_size: int = 64,
        backend: str | None = None,
    ) -> None:
        self.cfg, self.name, self.chunk_size = cfg, name, chunk_size
        self.backend = default_backend() if backend is None else backend
        if self.backend not in KERNEL_BACKENDS:
            raise PaceError(f"backend: {self.backend!r} not allowed; allowed: {', '.join(KERNEL_BACKENDS)}")
        self.batch, self.num_k_heads, self.num_v_heads, self.d_k, self.d_v = batch, num_k_heads, num_v_heads, d_k, d_v
        self.device = torch.device(device)
        self.shape = (batch, num_v_heads, d_k, d_v)
        if cfg.method == "none":
            self.reference_dtype = getattr(torch, cfg.reference_dtype)
            self.bits_per_head = (cfg.bits,) * num_v_heads
        else:
            if cfg.high_heads is not None and any(h >= num_v_heads for h in cfg.high_heads[gdn_index]):
                raise PaceError(
                    f"high_heads[{gdn_index}]: {cfg.high_heads[gdn_index]} not allowed ({name}); "
                    f"allowed: value heads 0..{num_v_heads - 1}"
                )
            self.bits_per_head = cfg.head_bits(gdn_index, num_v_heads)
        self.decode_period = cfg.decode_period
        self.damp_rows = damp_rows
        self._allocate(self.device)

    def _allocate(self, device: torch.device) -> None:
        """(Re-)create the empty layer state on ``device``: zero checkpoint, empty buffer."""
        self.device = device
        self.damp = self._damp_quantizer(self.damp_rows) if self.cfg.method == "damp" else None
        self.buffer = None
        self._plan = None  # (checkpoint, kernels.decode_step.DecodePlan) of the kernel path
        if self.decode_period > 1:
            self.buffer = DecodeBuffer(self.batch, self.num_k_heads, self.num_v_heads, self.d_k, self.d_v,
                                       self.decode_period, self.cfg.buffer, device)
        self._use_kernels = self._kernels_apply()
        self.reset()

    def _damp_quantizer(self, rows: torch.Tensor | None) -> DampQuantizer:
        cfg = self.cfg
        expected = (self.num_v_heads, cfg.damp_outlier_rows)
        if rows is None or not isinstance(rows, torch.Tensor) or tuple(rows.shape) != expected:
            got = None if rows is None else tuple(getattr(rows, "shape", ()))
            raise PaceError(
                f"damp_rows: {got} for {self.name} not allowed; allowed: calibrated outlier rows [HV, "
                f"damp_outlier_rows] = {list(expected)} per GDN layer (pace_core.outliers.rank_outlier_rows)"
            )
        return DampQuantizer(rows.to(self.device), cfg.bits, cfg.damp_hadamard, cfg.group_size)

    def quantize(self, S: torch.Tensor) -> Checkpoint:
        """Store ``S [B, HV, K, V]`` in this layer's format (non-finite values raise PaceError)."""
        quant.check_finite(S, self.name)
        method = self.cfg.method
        if method == "none":
            return S.to(self.reference_dtype)
        if method == "dsq":
            return dsq_quantize(S, self.cfg.bits, name=self.name)
        if method == "damp":
            return self.damp.quantize(S, name=self.name)
        if len(set(self.bits_per_head)) == 1:
            return quant.quantize(S, self.cfg.quant_spec(self.bits_per_head[0]), name=self.name)
        return quant.quantize_heads(S, self.bits_per_head, self.cfg.quant_spec(), name=self.name)

    def dequantized(self) -> torch.Tensor:
        """The dequantised checkpoint ``Ŝ [B, HV, K, V]`` float32."""
        c = self.checkpoint
        if isinstance(c, torch.Tensor):
            return c.float()
        if isinstance(c, quant.PackedTensor):
            return quant.dequantize(c)
        if isinstance(c, quant.MixedPackedState):
            return c.dequantize()
        if isinstance(c, DSQTensor):
            return dsq_dequantize(c)
        return self.damp.dequantize(c)

    def _check(self, q, k, v, g, beta) -> int:
        if q.dim() != 4:
            raise PaceError(f"q: shape {tuple(q.shape)} not allowed; allowed: [B, T, H, K]")
        T = q.shape[1]
        B, H, HV, K, V = self.batch, self.num_k_heads, self.num_v_heads, self.d_k, self.d_v
        for name, t, shape in (("q", q, (B, T, H, K)), ("k", k, (B, T, H, K)), ("v", v, (B, T, HV, V)),
                               ("g", g, (B, T, HV)), ("beta", beta, (B, T, HV))):
            if tuple(t.shape) != shape:
                raise PaceError(f"{name}: shape {tuple(t.shape)} not allowed ({self.name}); allowed: {shape}")
        if q.device != self.device:
            if self.used:
                raise PaceError(f"q: device {q.device} not allowed ({self.name}); allowed: {self.device}")
            self._allocate(q.device)
        self.used = self.used or T > 0
        return T

    def flush(self) -> None:
        """Fold the buffered records into the checkpoint, re-quantise it and clear the buffer."""
        if self.buffer is not None and len(self.buffer):
            self.checkpoint = self.quantize(fold(self.dequantized(), self.buffer))
            self.buffer.clear()

    def prefill(self, q, k, v, g, beta) -> torch.Tensor:
        """Prompt tokens ``q, k [B, T, H, K]`` (prepared), ``v [B, T, HV, V]``, ``g, beta [B, T, HV]``
        in P-token segments from the dequantised checkpoint, after buffered decode tokens as
        ``cfg.prefill_after_decode`` says (module docstring; under ``carry`` an empty prompt keeps the
        buffer); returns ``o [B, T, HV, V]`` float32."""
        T = self._check(q, k, v, g, beta)
        if self.cfg.prefill_after_decode == "carry" and self.buffer is not None and len(self.buffer):
            if T == 0:
                return torch.zeros(self.batch, 0, self.num_v_heads, self.d_v, device=self.device)
            initial = self.effective_state()
        else:
            self.flush()
            initial = self.dequantized()
        period = self.cfg.prefill_period

        def round_fn(S: torch.Tensor) -> torch.Tensor:
            self.checkpoint = self.quantize(S)
            if self.buffer is not None:  # carry: the checkpoint now holds the buffered tokens too
                self.buffer.clear()
            return self.dequantized()

        o, _ = gdn_prefill_segmented(q, k, v, g, beta, initial, period, round_fn, self.chunk_size)
        return o

    def uses_kernels(self) -> bool:
        """Whether :meth:`decode` runs on the Triton kernels (module docstring; fixed per device)."""
        return self._use_kernels

    def _kernels_apply(self) -> bool:
        if self.backend == "reference" or (self.backend == "auto" and self.device.type != "cuda"):
            return False
        if self.cfg.method not in ("none", "rtn", "pace") or (self.buffer is None and self.cfg.method != "none"):
            return False
        if self.buffer is not None and self.buffer.precision == "fp64":
            return False
        if self.cfg.method == "none" and self.reference_dtype not in (torch.float32, torch.bfloat16):
            return False
        from kernels.quant_pack import check_kernel_shape

        try:
            check_kernel_shape(self.d_k, self.d_v, self.cfg.quant_spec() if self.cfg.quantized else
                               quant.QuantSpec(8, True, "key", 1), self.name, decode=True)
        except PaceError:
            return False
        return True

    def decode(self, q, k, v, g, beta) -> torch.Tensor:
        """Decode tokens one by one (shapes as :meth:`prefill`), flushing every dP tokens."""
        T = self._check(q, k, v, g, beta)
        steps = self._kernel_steps if self._use_kernels else self._reference_steps
        outputs = steps(q, k, v, g, beta, T)
        if not outputs:
            return torch.zeros(self.batch, 0, self.num_v_heads, self.d_v, device=self.device)
        return torch.stack(outputs, dim=1)

    def _reference_steps(self, q, k, v, g, beta, T: int) -> list[torch.Tensor]:
        S_hat = self.dequantized()
        outputs = []
        for t in range(T):
            step = slice(t, t + 1)
            if self.buffer is None:
                o, S = gdn_recurrent(q[:, step], k[:, step], v[:, step], g[:, step], beta[:, step], S_hat)
                outputs.append(o[:, 0])
                self.checkpoint = self.quantize(S)
                S_hat = self.dequantized()
                continue
            outputs.append(buffered_step(S_hat, self.buffer, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t]))
            if len(self.buffer) == self.decode_period:
                self.flush()
                S_hat = self.dequantized()
        return outputs

    def _kernel_steps(self, q, k, v, g, beta, T: int) -> list[torch.Tensor]:
        """The decode steps on the Triton kernels (through :mod:`kernels.dispatch`): the checkpoint is
        updated in place, so the launch plan is made once per checkpoint (a prefill, reset or reorder
        makes a new one); one device sync per token checks the inputs, except while a CUDA graph is
        being captured (no sync is possible there: a graph's replays do not check their inputs), and
        the launches go to the layer's own GPU (under ``device_map``)."""
        from kernels.decode_step import plan_decode
        from kernels.dispatch import decode_step, dense_step

        outputs = []
        with torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext():
            capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            for t in range(T):
                x = (q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
                if not capturing and not bool(
                        torch.isfinite(x[1]).all() & torch.isfinite(x[2]).all() & torch.isfinite(x[3]).all()):
                    raise PaceError(f"k, v, g of {self.name}: non-finite values; allowed: finite inputs")
                if self.buffer is None:
                    outputs.append(dense_step(self.checkpoint, *x, backend="triton"))
                    continue
                if self._plan is None or self._plan[0] is not self.checkpoint:
                    self._plan = (self.checkpoint, plan_decode(self.checkpoint, self.buffer))
                o, _ = decode_step(self.checkpoint, self.buffer, *x, self.decode_period, backend="triton",
                                   plan=self._plan[1], check_finite=False)
                outputs.append(o)
        return outputs

    def effective_state(self) -> torch.Tensor:
        """Checkpoint plus folded buffer: ``S [B, HV, K, V]`` float32."""
        S_hat = self.dequantized()
        return S_hat if self.buffer is None else fold(S_hat, self.buffer)

    def nbytes(self) -> dict[str, int]:
        """``{"payload", "metadata", "buffer"}`` real bytes (module docstring)."""
        payload, metadata = checkpoint_bytes(self.checkpoint)
        buffer = 0 if self.buffer is None else self.buffer.nbytes_allocated()
        return {"payload": payload, "metadata": metadata, "buffer": buffer}

    def reorder(self, index: torch.Tensor) -> None:
        """Batch row ``b`` becomes old row ``index[b]``."""
        index = index.to(self.device)
        self.checkpoint = _reorder(self.checkpoint, index)
        if self.buffer is not None:
            self.buffer.reorder(index)

    def reset(self) -> None:
        """Zero state, empty buffer (the layer counts as unused again)."""
        self.checkpoint = self.quantize(torch.zeros(self.shape, device=self.device))
        if self.buffer is not None:
            self.buffer.clear()
        self.used = False


class StateStore:
    """The recurrent state of one model: a :class:`LayerState` per GDN layer.

    ``layers`` are the model's layer indices of the GDN layers (``cfg.high_heads`` and
    ``damp_rows`` are in the same order); ``shape``, when given, must agree with the head counts
    and dims. q, k passed to :meth:`prefill` / :meth:`decode` are prepared
    (:func:`pace_core.recurrence.prepare_qk`).
    """

    def __init__(
        self,
        cfg: PaceConfig,
        shape: ModelShape | None,
        batch: int,
        device: torch.device | str,
        num_k_heads: int,
        num_v_heads: int,
        d_k: int,
        d_v: int,
        layers: list[int],
        *,
        damp_rows: Sequence[torch.Tensor] | None = None,
        chunk_size: int = 64,
        backend: str | None = None,
    ) -> None:
        cfg = cfg.validate()
        if shape is not None:
            cfg.validate_for(shape)
            for field, value in (("num_k_heads", num_k_heads), ("num_v_heads", num_v_heads), ("d_k", d_k),
                                 ("d_v", d_v)):
                if getattr(shape, field) != value:
                    raise PaceError(
                        f"{field}: {value} not allowed; allowed: {getattr(shape, field)} (model shape {shape.name})"
                    )
        layers = list(layers)
        if len(set(layers)) != len(layers):
            raise PaceError(f"layers: {layers} not allowed; allowed: distinct layer indices")
        high = cfg.high_heads
        if high is not None and len(high) != len(layers):
            raise PaceError(
                f"high_heads: {len(high)} layers not allowed; allowed: one entry per GDN layer ({len(layers)})"
            )
        if damp_rows is not None and len(damp_rows) != len(layers):
            raise PaceError(
                f"damp_rows: {len(damp_rows)} layers not allowed; allowed: one [HV, r] tensor per GDN layer "
                f"({len(layers)})"
            )
        self.cfg, self.batch, self.layers, self.device = cfg, batch, layers, torch.device(device)
        self._states = {
            layer: LayerState(
                cfg, batch, num_k_heads, num_v_heads, d_k, d_v, device,
                gdn_index=i,
                damp_rows=None if damp_rows is None else damp_rows[i],
                name=f"state of GDN layer {layer}",
                chunk_size=chunk_size,
                backend=backend,
            )
            for i, layer in enumerate(layers)
        }

    def layer(self, layer: int) -> LayerState:
        """The :class:`LayerState` of model layer ``layer``."""
        if layer not in self._states:
            raise PaceError(f"layer: {layer!r} not allowed; allowed: the GDN layers {self.layers}")
        return self._states[layer]

    def prefill(self, layer: int, q, k, v, g, beta) -> torch.Tensor:
        """Prompt tokens of one layer (:meth:`LayerState.prefill`): ``o [B, T, HV, V]``."""
        return self.layer(layer).prefill(q, k, v, g, beta)

    def decode(self, layer: int, q, k, v, g, beta) -> torch.Tensor:
        """Decode tokens of one layer (:meth:`LayerState.decode`): ``o [B, T, HV, V]``."""
        return self.layer(layer).decode(q, k, v, g, beta)

    def effective_state(self, layer: int) -> torch.Tensor:
        """Checkpoint + folded buffer of one layer: ``S [B, HV, K, V]`` float32."""
        return self.layer(layer).effective_state()

    def checkpoint_dequantized(self, layer: int) -> torch.Tensor:
        """The dequantised checkpoint ``Ŝ [B, HV, K, V]`` float32 of one layer."""
        return self.layer(layer).dequantized()

    def bits_per_head(self, layer: int) -> tuple[int, ...]:
        """Storage bits of each value head of one layer."""
        return self.layer(layer).bits_per_head

    def buffer(self, layer: int) -> DecodeBuffer | None:
        """The decode buffer of one layer (None at dP = 1)."""
        return self.layer(layer).buffer

    def has_state(self, layer: int) -> bool:
        """True once the layer has received tokens (since construction or :meth:`reset`)."""
        return self.layer(layer).used

    def layer_nbytes(self, layer: int) -> dict[str, int]:
        """``{"payload", "metadata", "buffer"}`` real bytes of one layer."""
        return self.layer(layer).nbytes()

    def nbytes(self) -> int:
        """Real bytes of all layers (payload + metadata + buffer)."""
        return sum(sum(s.nbytes().values()) for s in self._states.values())

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Reorder the batch rows of every layer: row ``b`` becomes old row ``beam_idx[b]``."""
        index = torch.as_tensor(beam_idx, dtype=torch.long, device=self.device)
        if index.shape != (self.batch,) or not 0 <= int(index.min()) <= int(index.max()) < self.batch:
            raise PaceError(
                f"beam_idx: {index.tolist()} not allowed; allowed: {self.batch} row indices in 0..{self.batch - 1}"
            )
        for s in self._states.values():
            s.reorder(index)

    def reset(self) -> None:
        """Zero state and empty buffers in every layer."""
        for s in self._states.values():
            s.reset()
