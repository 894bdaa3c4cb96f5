"""The PACE decode buffer (spec §3): per decode token since the last checkpoint it holds the key
``k_t [B, H, K]`` (per key head), the delta value ``u_t [B, HV, V]`` (per value head) and the log
decay ``g_t [B, HV]``.

Precisions (``precision``):

- ``fp32`` / ``bf16``: keys and values as float32 / bfloat16;
- ``int8``: keys and values 8-bit symmetric, one fp16 scale per vector (per key head for keys,
  per value head for values) **[ours]**;
- ``mixed``: keys 4-bit symmetric with one fp16 scale per key vector, values bfloat16;
- ``fp64``: keys, values and log decays as float64 — a test/analysis reference only (not a
  :class:`~pace_core.config.PaceConfig` choice).

Log decays are float32 (float64 for ``fp64``). Integer vectors go through :mod:`pace_core.quant`
(a vector ``[..., n]`` is quantised as a ``[..., 1, n]`` matrix with one value-axis group of size n),
so the codes are that module's packed storage (two 4-bit codes per byte).

Bytes: storage for ``capacity`` records is allocated up front. :meth:`DecodeBuffer.nbytes` is the
real bytes of the records held, :meth:`DecodeBuffer.nbytes_allocated` the bytes allocated. Per
record and sequence that is ``H·K·b_k/8 + HV·V·b_v/8 + 4·HV`` bytes, i.e. ``HV · c · K · V / 8`` with
spec §5's ``c = (b_k K / γ + b_v V + 32) / (K V)``, plus 2 bytes per fp16 scale (``H`` key scales for
int8 / mixed, ``HV`` value scales for int8); see :func:`record_bytes`.
"""

from __future__ import annotations

from typing import Literal

import torch

from pace_core import quant
from pace_core.errors import PaceError

Precision = Literal["fp32", "bf16", "int8", "mixed", "fp64"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "int8", "mixed", "fp64")

# precision -> (key storage, value storage): a torch dtype or an integer bit width (kernels read it too)
BUFFER_LAYOUT: dict[str, tuple[torch.dtype | int, torch.dtype | int]] = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "int8": (8, 8),
    "mixed": (4, torch.bfloat16),
    "fp64": (torch.float64, torch.float64),
}


def _bits(kind: torch.dtype | int) -> int:
    return kind if isinstance(kind, int) else torch.finfo(kind).bits


def entry_bits(precision: str) -> tuple[int, int]:
    """``(b_k, b_v)``: bits per buffered key / value entry of ``precision`` (spec §5's ``c``)."""
    key_kind, value_kind = BUFFER_LAYOUT[precision]
    return _bits(key_kind), _bits(value_kind)


def record_bytes(precision: str, num_k_heads: int, num_v_heads: int, d_k: int, d_v: int) -> int:
    """Bytes of one buffered record of one sequence: keys + values + log decays + fp16 scales."""
    if precision not in BUFFER_LAYOUT:
        raise PaceError(f"precision: {precision!r} not allowed; allowed: {', '.join(PRECISIONS)}")
    key_kind, value_kind = BUFFER_LAYOUT[precision]
    decay_bytes = 8 if precision == "fp64" else 4
    key_bits = num_k_heads * d_k * _bits(key_kind)
    value_bits = num_v_heads * d_v * _bits(value_kind)
    scale_bytes = 2 * (num_k_heads * isinstance(key_kind, int) + num_v_heads * isinstance(value_kind, int))
    return (key_bits + value_bits) // 8 + decay_bytes * num_v_heads + scale_bytes


class _VectorStore:
    """Capacity-sized storage for vectors ``[B, heads, n]`` in a float dtype or as packed integers.

    Float: ``data [B, capacity, heads, n]``. Integer: ``codes [B, capacity, heads, m]`` uint8 (m =
    ceil(n/2) for 4-bit, n for 8-bit; :mod:`pace_core.quant`'s packing) and ``scale [B, capacity,
    heads]`` float16.
    """

    def __init__(self, batch: int, capacity: int, heads: int, length: int, kind, device) -> None:
        self.kind = kind
        self.length = length
        if isinstance(kind, int):
            self.spec = quant.QuantSpec(bits=kind, symmetric=True, axis="value", group_size=length)
            width = quant.packed_last_dim(kind, length)
            self.codes = torch.zeros(batch, capacity, heads, width, dtype=torch.uint8, device=device)
            self.scale = torch.zeros(batch, capacity, heads, dtype=torch.float16, device=device)
            self.tensors = [self.codes, self.scale]
        else:
            self.data = torch.zeros(batch, capacity, heads, length, dtype=kind, device=device)
            self.tensors = [self.data]

    def write(self, slot: int, x: torch.Tensor) -> None:
        """Store ``x [B, heads, n]`` at record ``slot``."""
        if isinstance(self.kind, int):
            packed = quant.quantize(x.unsqueeze(-2), self.spec, name="decode buffer vector")
            self.codes[:, slot] = packed.codes.squeeze(-2)
            self.scale[:, slot] = packed.scale.reshape(self.scale[:, slot].shape)
        else:
            self.data[:, slot] = x.to(self.kind)

    def read(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """The first ``n`` records, dequantised: ``[B, n, heads, length]``."""
        if isinstance(self.kind, int):
            B, _, heads, _ = self.codes.shape
            packed = quant.PackedTensor(
                codes=self.codes[:, :n].unsqueeze(-2),
                scale=self.scale[:, :n, :, None, None],
                zero=None,
                spec=self.spec,
                shape=(B, n, heads, 1, self.length),
            )
            return quant.dequantize(packed, dtype).squeeze(-2)
        return self.data[:, :n].to(dtype)

    def reorder(self, index: torch.Tensor) -> None:
        for t in self.tensors:
            t.copy_(t.index_select(0, index))

    def nbytes(self, n: int | None) -> int:
        return sum((t if n is None else t[:, :n]).numel() * t.element_size() for t in self.tensors)

    def storage(self, name: str, scale_name: str) -> dict[str, torch.Tensor]:
        if isinstance(self.kind, int):
            return {name: self.codes, scale_name: self.scale}
        return {name: self.data}


class DecodeBuffer:
    """Records ``(k_t, u_t, g_t)`` since the last checkpoint, in ``precision`` (module docstring).

    ``batch`` B sequences, ``num_k_heads`` H, ``num_v_heads`` HV (a multiple of H), ``d_k`` K,
    ``d_v`` V, room for ``capacity`` records.
    """

    def __init__(
        self,
        batch: int,
        num_k_heads: int,
        num_v_heads: int,
        d_k: int,
        d_v: int,
        capacity: int,
        precision: str,
        device: torch.device | str = "cpu",
    ) -> None:
        if precision not in BUFFER_LAYOUT:
            raise PaceError(f"precision: {precision!r} not allowed; allowed: {', '.join(PRECISIONS)}")
        for name, value in (("batch", batch), ("num_k_heads", num_k_heads), ("num_v_heads", num_v_heads),
                            ("d_k", d_k), ("d_v", d_v), ("capacity", capacity)):
            if not isinstance(value, int) or value < 1:
                raise PaceError(f"{name}: {value!r} not allowed; allowed: an integer >= 1")
        if num_v_heads % num_k_heads != 0:
            raise PaceError(
                f"num_v_heads: {num_v_heads} not allowed; allowed: a multiple of num_k_heads={num_k_heads}"
            )
        self.batch, self.num_k_heads, self.num_v_heads = batch, num_k_heads, num_v_heads
        self.d_k, self.d_v, self.capacity, self.precision = d_k, d_v, capacity, precision
        self.dtype = torch.float64 if precision == "fp64" else torch.float32
        """dtype of the dequantised keys / values / log decays."""
        key_kind, value_kind = BUFFER_LAYOUT[precision]
        self._keys = _VectorStore(batch, capacity, num_k_heads, d_k, key_kind, device)
        self._values = _VectorStore(batch, capacity, num_v_heads, d_v, value_kind, device)
        self._decays = torch.zeros(batch, capacity, num_v_heads, dtype=self.dtype, device=device)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    @property
    def device(self) -> torch.device:
        """Where the records are stored."""
        return self._decays.device

    def append(self, k: torch.Tensor, u: torch.Tensor, g: torch.Tensor) -> None:
        """Append one record: ``k [B, H, K]``, ``u [B, HV, V]``, ``g [B, HV]``."""
        B, H, HV = self.batch, self.num_k_heads, self.num_v_heads
        for name, t, shape in (("k", k, (B, H, self.d_k)), ("u", u, (B, HV, self.d_v)), ("g", g, (B, HV))):
            if tuple(t.shape) != shape:
                raise PaceError(f"{name}: shape {tuple(t.shape)} not allowed; allowed: {shape}")
        if self._len == self.capacity:
            raise PaceError(f"buffer: full at capacity={self.capacity}; allowed: fold and clear it first")
        for name, t in (("k", k), ("u", u), ("g", g)):
            if not torch.isfinite(t).all():
                raise PaceError(f"{name}: non-finite values not allowed in the decode buffer; allowed: finite values")
        self._keys.write(self._len, k)
        self._values.write(self._len, u)
        self._decays[:, self._len] = g.to(self.dtype)
        self._len += 1

    def keys(self) -> torch.Tensor:
        """Stored keys, dequantised: ``[B, n, H, K]`` in :attr:`dtype`."""
        return self._keys.read(self._len, self.dtype)

    def values(self) -> torch.Tensor:
        """Stored delta values ``u``, dequantised: ``[B, n, HV, V]`` in :attr:`dtype`."""
        return self._values.read(self._len, self.dtype)

    def log_decays(self) -> torch.Tensor:
        """Stored log decays ``g``: ``[B, n, HV]`` in :attr:`dtype`."""
        return self._decays[:, : self._len].clone()

    def storage(self) -> dict[str, torch.Tensor]:
        """The live storage tensors (not copies), for kernels that write records in place:
        ``keys`` (``[B, capacity, H, K]`` float, or ``[B, capacity, H, m]`` uint8 codes),
        ``key_scale`` (``[B, capacity, H]`` fp16, integer keys only), ``values`` / ``value_scale``
        likewise with HV and V, ``log_decays [B, capacity, HV]``. Codes are :mod:`pace_core.quant`'s
        packed symmetric codes of one value-axis group per vector."""
        return {
            **self._keys.storage("keys", "key_scale"),
            **self._values.storage("values", "value_scale"),
            "log_decays": self._decays,
        }

    def mark_appended(self, n: int = 1) -> None:
        """Count ``n`` records that a kernel wrote in place into slots ``len .. len + n - 1``."""
        if not isinstance(n, int) or n < 0 or self._len + n > self.capacity:
            raise PaceError(
                f"n: {n!r} not allowed; allowed: an integer 0..{self.capacity - self._len} (free slots)"
            )
        self._len += n

    def clear(self) -> None:
        """Forget all records (storage stays allocated)."""
        self._len = 0

    def reorder(self, index: torch.Tensor) -> None:
        """Reorder the batch rows: row ``b`` becomes old row ``index[b]`` (beam search)."""
        index = torch.as_tensor(index, dtype=torch.long, device=self._decays.device)
        if index.shape != (self.batch,):
            raise PaceError(f"beam_idx: shape {tuple(index.shape)} not allowed; allowed: ({self.batch},)")
        self._keys.reorder(index)
        self._values.reorder(index)
        self._decays.copy_(self._decays.index_select(0, index))

    def nbytes(self) -> int:
        """Real bytes of the records held (all B sequences)."""
        decay = self._decays[:, : self._len]
        return self._keys.nbytes(self._len) + self._values.nbytes(self._len) + decay.numel() * decay.element_size()

    def nbytes_allocated(self) -> int:
        """Real bytes of the storage allocated for ``capacity`` records."""
        return (
            self._keys.nbytes(None)
            + self._values.nbytes(None)
            + self._decays.numel() * self._decays.element_size()
        )
