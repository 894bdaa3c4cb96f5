"""The PACE decode buffer (spec §3): per decode token since the last checkpoint it holds the key
``k_t [B, H, K]`` (per key head), the delta value ``u_t [B, HV, V]`` (per value head) and the log
decay ``g_t [B, HV]``.

Precisions (:class:`BufferFormat`'s ``precision``):

- ``fp32`` / ``bf16``: keys and values as float32 / bfloat16;
- ``int8``: keys and values 8-bit;
- ``mixed``: keys 4-bit, values bfloat16;
- ``fp64``: keys, values and log decays as float64 — a test/analysis reference only (not a
  :class:`~pace_core.config.PaceConfig` choice).

Integer vectors are stored as :mod:`pace_core.quant` stores them: a vector ``[..., n]`` is a ``[..., 1, n]``
matrix with value-axis groups of ``key_group`` / ``value_group`` entries (0: one group, the whole
vector) **[ours]**, each with an fp16 scale and, unless ``key_symmetric`` / ``value_symmetric``, an
integer zero point in b bits **[ours]**; so the codes are that module's packed storage (two 4-bit codes
per byte). Log decays are float32 (float64 for ``fp64``).

Bytes: storage for ``capacity`` records is allocated up front. :meth:`DecodeBuffer.nbytes` is the real
bytes of the records held, :meth:`DecodeBuffer.nbytes_allocated` the bytes allocated; one record of one
sequence is :func:`record_bytes`, ``H·K·b_k/8 + HV·V·b_v/8 + 4·HV`` where ``b_k, b_v`` are the entries'
bits with their share of the group scales and zero points (:func:`entry_bits`), i.e. ``HV · c · K · V / 8``
with spec §5's ``c = (b_k K / γ + b_v V + 32) / (K V)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch

from pace_core import quant
from pace_core.errors import PaceError

PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "int8", "mixed", "fp64")

# precision -> (key storage, value storage): a torch dtype or an integer bit width (kernels read it too)
BUFFER_LAYOUT: dict[str, tuple[torch.dtype | int, torch.dtype | int]] = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "int8": (8, 8),
    "mixed": (4, torch.bfloat16),
    "fp64": (torch.float64, torch.float64),
}


@dataclass(frozen=True)
class BufferFormat:
    """How a record is stored: ``precision`` (module docstring) and, for the integer parts, the group size
    along each key / value vector (0: the whole vector) and whether its groups are symmetric (else each
    carries a zero point). The integer parts' settings must divide the vectors (checked by the buffer)."""

    precision: str = "fp32"
    key_group: int = 0
    value_group: int = 0
    key_symmetric: bool = True
    value_symmetric: bool = True

    def __post_init__(self) -> None:
        if self.precision not in BUFFER_LAYOUT:
            raise PaceError(f"precision: {self.precision!r} not allowed; allowed: {', '.join(PRECISIONS)}")

    def spec(self, part: str, length: int) -> quant.QuantSpec | None:
        """The quantiser of the ``key`` or ``value`` vectors of ``length`` entries, None when they are
        stored as floats."""
        kind = BUFFER_LAYOUT[self.precision][0 if part == "key" else 1]
        if not isinstance(kind, int):
            return None
        group = self.key_group if part == "key" else self.value_group
        symmetric = self.key_symmetric if part == "key" else self.value_symmetric
        group = group or length
        quant.check_divides(group, length, "vector", f"buffer {part}s")
        return quant.QuantSpec(bits=kind, symmetric=symmetric, axis="value", group_size=group)


def as_format(fmt: BufferFormat | str) -> BufferFormat:
    """A :class:`BufferFormat`; a precision name means its per-vector symmetric format."""
    return fmt if isinstance(fmt, BufferFormat) else BufferFormat(fmt)


def _vector_bytes(fmt: BufferFormat, part: str, heads: int, length: int) -> int:
    """Bytes of one record's ``heads`` vectors of ``length`` entries (codes, scales, zero points)."""
    spec = fmt.spec(part, length)
    if spec is None:
        kind = BUFFER_LAYOUT[fmt.precision][0 if part == "key" else 1]
        return heads * length * torch.finfo(kind).bits // 8
    return quant.packed_nbytes((heads, 1, length), spec)


def entry_bits(fmt: BufferFormat | str, d_k: int, d_v: int) -> tuple[Fraction, Fraction]:
    """``(b_k, b_v)``: stored bits per buffered key / value entry (exact), each entry's share of its group's
    fp16 scale and zero point included (spec §5's ``c`` with this buffer's grouping; per-vector int8 keys
    of ``d_k = 128``: ``8 + 16/128``)."""
    fmt = as_format(fmt)
    return Fraction(8 * _vector_bytes(fmt, "key", 1, d_k), d_k), Fraction(8 * _vector_bytes(fmt, "value", 1, d_v), d_v)


def record_bytes(fmt: BufferFormat | str, num_k_heads: int, num_v_heads: int, d_k: int, d_v: int) -> int:
    """Bytes of one buffered record of one sequence: keys + values (with their scales and zero points)
    + log decays."""
    fmt = as_format(fmt)
    decay_bytes = 8 if fmt.precision == "fp64" else 4
    return (_vector_bytes(fmt, "key", num_k_heads, d_k) + _vector_bytes(fmt, "value", num_v_heads, d_v)
            + decay_bytes * num_v_heads)


def _heads(p: quant.PackedTensor, heads: slice) -> quant.PackedTensor:
    """The heads ``heads`` of packed records ``[B, n, heads, 1, length]``."""
    pick = (slice(None), slice(None), heads)
    return quant.PackedTensor(p.codes[pick], p.scale[pick], None if p.zero is None else p.zero[pick], p.spec,
                              (*p.shape[:2], len(range(*heads.indices(p.shape[2]))), *p.shape[3:]))


EMPTY = 1.0
"""The log decay that marks a buffer slot holding no record (a record's log decay is <= 0), so that what a
buffer holds can be read from its storage alone: a state pool's rows hold different counts (:func:`records_held`)."""


def records_held(log_decays: torch.Tensor) -> torch.Tensor:
    """The records each row holds: ``log_decays [N, capacity, HV]`` -> ``[N]`` long (records fill the first slots;
    an empty slot's decay is :data:`EMPTY`)."""
    return (log_decays[..., 0] <= 0).sum(-1)


class _VectorStore:
    """Capacity-sized storage for vectors ``[B, heads, n]`` in a float dtype or as packed integers.

    Float: ``data [B, capacity, heads, n]``. Integer (``spec``): ``codes [B, capacity, heads, m]`` uint8 (m =
    ceil(n/2) for 4-bit, n for 8-bit; :mod:`pace_core.quant`'s packing), ``scale [B, capacity, heads, n/g]``
    float16 and, with zero points, ``zero [B, capacity, heads, z]`` uint8 (packed like the codes when 4-bit
    and n/g is even).
    """

    def __init__(self, batch: int, capacity: int, heads: int, length: int, kind, spec: quant.QuantSpec | None,
                 device, names: tuple[str, str, str], storage: dict[str, torch.Tensor] | None = None) -> None:
        """``names``: the storage's names of the data (or codes), scales and zero points; ``storage``: existing
        tensors of those names to hold the records in (a state pool's rows), else new zeros."""
        self.kind, self.spec, self.length, self.names = kind, spec, length, names
        if storage is None:
            storage = {}
            if spec is not None:
                packed = quant.quantize(torch.zeros(1, 1, length, device=device), spec)
                storage[names[0]] = torch.zeros(batch, capacity, heads, packed.codes.shape[-1], dtype=torch.uint8,
                                                device=device)
                storage[names[1]] = torch.zeros(batch, capacity, heads, packed.scale.shape[-1], dtype=torch.float16,
                                                device=device)
                if packed.zero is not None:
                    storage[names[2]] = torch.zeros(batch, capacity, heads, packed.zero.shape[-1], dtype=torch.uint8,
                                                    device=device)
            else:
                storage[names[0]] = torch.zeros(batch, capacity, heads, length, dtype=kind, device=device)
        if spec is not None:
            self.codes, self.scale, self.zero = storage[names[0]], storage[names[1]], storage.get(names[2])
            self.tensors = [t for t in (self.codes, self.scale, self.zero) if t is not None]
        else:
            self.data = storage[names[0]]
            self.tensors = [self.data]

    def rounded(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``x [..., heads, n]`` as this store would read it back after writing it, in ``dtype`` (no write)."""
        if self.spec is None:
            return x.to(self.kind).to(dtype)
        return quant.fake_quantize(x.unsqueeze(-2), self.spec, dtype, name="decode buffer vector",
                                   checked=True).squeeze(-2)

    def write(self, slot: int, x: torch.Tensor, packed: quant.PackedTensor | None = None) -> None:
        """Store ``x [B, n, heads, length]`` (finite: :meth:`DecodeBuffer.extend` checks it) at records
        ``slot .. slot + n - 1``; each vector is quantised on its own, so writing records together or one
        by one stores the same codes. ``packed``: ``x``'s packed form (of shape ``[B, n, heads, 1, length]``),
        when the caller made it."""
        self._store((slice(None), slice(slot, slot + x.shape[1])), x, packed)

    def write_at(self, rows: torch.Tensor, at: torch.Tensor, x: torch.Tensor) -> None:
        """Store one record per row: ``x [n, heads, length]`` at record ``at[i]`` of row ``rows[i]`` (long ``[n]``)."""
        self._store((rows, at), x[:, None], None, squeeze=True)

    def _store(self, where: tuple, x: torch.Tensor, packed: quant.PackedTensor | None, squeeze: bool = False) -> None:
        """``x [n_rows, n, heads, length]`` (packed: ``[.., 1, length]``) into the records ``where`` indexes."""
        shape = (lambda t: t[:, 0]) if squeeze else (lambda t: t)
        if self.spec is None:
            self.data[where] = shape(x.to(self.kind))
            return
        packed = packed or quant.quantize(x.unsqueeze(-2), self.spec, checked=True, name="decode buffer vector")
        self.codes[where] = shape(packed.codes.squeeze(-2))
        self.scale[where] = shape(packed.scale.squeeze(-2))
        if self.zero is not None:
            self.zero[where] = shape(packed.zero.squeeze(-2))

    def read(self, n: int, dtype: torch.dtype, copy: bool = True, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The first ``n`` records, dequantised: ``[B, n, heads, length]`` (``copy=False``: a view of the
        storage where it holds them as they are, valid until the next write); ``rows``: of these rows only."""
        pick = (lambda t: t[:, :n]) if rows is None else (lambda t: t[rows, :n])
        if self.spec is not None:
            codes = pick(self.codes)
            packed = quant.PackedTensor(
                codes=codes.unsqueeze(-2),
                scale=pick(self.scale).unsqueeze(-2),
                zero=None if self.zero is None else pick(self.zero).unsqueeze(-2),
                spec=self.spec,
                shape=(codes.shape[0], n, codes.shape[2], 1, self.length),
            )
            return quant.dequantize(packed, dtype).squeeze(-2)
        return pick(self.data).to(dtype, copy=copy)

    def reorder(self, index: torch.Tensor) -> None:
        for t in self.tensors:
            t.copy_(t.index_select(0, index))

    def nbytes(self, n: int | None) -> int:
        return sum((t if n is None else t[:, :n]).numel() * t.element_size() for t in self.tensors)

    def storage(self) -> dict[str, torch.Tensor]:
        if self.spec is None:
            return {self.names[0]: self.data}
        out = {self.names[0]: self.codes, self.names[1]: self.scale}
        if self.zero is not None:
            out[self.names[2]] = self.zero
        return out


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
        fmt: BufferFormat | str,
        device: torch.device | str = "cpu",
        storage: dict[str, torch.Tensor] | None = None,
        per_row: bool = False,
    ) -> None:
        fmt = as_format(fmt)
        precision = fmt.precision
        for name, value in (("batch", batch), ("num_k_heads", num_k_heads), ("num_v_heads", num_v_heads),
                            ("d_k", d_k), ("d_v", d_v), ("capacity", capacity)):
            if not isinstance(value, int) or value < 1:
                raise PaceError(f"{name}: {value!r} not allowed; allowed: an integer >= 1")
        if num_v_heads % num_k_heads != 0:
            raise PaceError(
                f"num_v_heads: {num_v_heads} not allowed; allowed: a multiple of num_k_heads={num_k_heads}"
            )
        self.batch, self.num_k_heads, self.num_v_heads = batch, num_k_heads, num_v_heads
        self.d_k, self.d_v, self.capacity, self.precision, self.format = d_k, d_v, capacity, precision, fmt
        self.dtype = torch.float64 if precision == "fp64" else torch.float32
        """dtype of the dequantised keys / values / log decays."""
        key_kind, value_kind = BUFFER_LAYOUT[precision]
        self._keys = _VectorStore(batch, capacity, num_k_heads, d_k, key_kind, fmt.spec("key", d_k), device,
                                  ("keys", "key_scale", "key_zero"), storage)
        self._values = _VectorStore(batch, capacity, num_v_heads, d_v, value_kind, fmt.spec("value", d_v), device,
                                    ("values", "value_scale", "value_zero"), storage)
        if storage is None:
            self._decays = torch.full((batch, capacity, num_v_heads), EMPTY, dtype=self.dtype, device=device)
            self._len = 0
        elif per_row:
            self._decays = storage["log_decays"]
            self._len = 0  # rows hold their own counts: the per-row methods below, not len()
        else:
            self._decays = storage["log_decays"]
            held = records_held(self._decays)
            self._len = int(held[0]) if held.numel() else 0
            if not bool((held == self._len).all()):
                raise PaceError(
                    f"storage: rows holding {sorted(set(held.tolist()))} records not allowed in one buffer; "
                    "allowed: rows holding the same number of records"
                )

    def __len__(self) -> int:
        return self._len

    @property
    def device(self) -> torch.device:
        """Where the records are stored."""
        return self._decays.device

    def append(self, k: torch.Tensor, u: torch.Tensor, g: torch.Tensor) -> None:
        """Append one record: ``k [B, H, K]``, ``u [B, HV, V]``, ``g [B, HV]``."""
        self._check(k, u, g, None)
        self.extend(k[:, None], u[:, None], g[:, None], checked=True)

    def extend(self, k: torch.Tensor, u: torch.Tensor, g: torch.Tensor, *, checked: bool = False) -> None:
        """Append ``n`` records at once: ``k [B, n, H, K]``, ``u [B, n, HV, V]``, ``g [B, n, HV]`` (the same
        records as ``n`` calls of :meth:`append`). ``checked``: shapes, room and finiteness already checked."""
        n = k.shape[1] if k.dim() == 4 else 0
        if not checked:
            self._check(k, u, g, n)
        keys, values = self._keys, self._values
        if keys.spec is not None and keys.spec == values.spec and self.d_k == self.d_v:
            # one quantisation for both vectors of the records: the same per-vector quantiser
            packed = quant.quantize(torch.cat([k, u], 2).unsqueeze(-2), keys.spec, checked=True,
                                    name="decode buffer vector")
            H = self.num_k_heads
            keys.write(self._len, k, _heads(packed, slice(0, H)))
            values.write(self._len, u, _heads(packed, slice(H, None)))
        else:
            keys.write(self._len, k)
            values.write(self._len, u)
        self._decays[:, self._len:self._len + n] = g.to(self.dtype)
        self._len += n

    def _check(self, k: torch.Tensor, u: torch.Tensor, g: torch.Tensor, n: int | None) -> None:
        """PaceError unless ``k, u, g`` are records of this buffer (``n`` None: one record's shapes, else ``n``
        records'), there is room for them and they are finite."""
        B, H, HV = self.batch, self.num_k_heads, self.num_v_heads
        records = () if n is None else (n,)
        for name, t, shape in (("k", k, (B, *records, H, self.d_k)), ("u", u, (B, *records, HV, self.d_v)),
                               ("g", g, (B, *records, HV))):
            if tuple(t.shape) != shape:
                raise PaceError(f"{name}: shape {tuple(t.shape)} not allowed; allowed: {shape}")
        n = 1 if n is None else n
        if self._len + n > self.capacity:
            raise PaceError(f"buffer: full at capacity={self.capacity} ({self._len} held, {n} more); allowed: "
                            "fold and clear it first")
        if not quant.all_finite(k, u, g):
            bad = [name for name, t in (("k", k), ("u", u), ("g", g)) if not torch.isfinite(t).all()]
            raise PaceError(f"{', '.join(bad)}: non-finite values not allowed in the decode buffer; allowed: finite "
                            "values")

    def rounded(self, part: str, x: torch.Tensor) -> torch.Tensor:
        """``x`` (keys ``[..., H, K]`` for ``part`` ``key``, delta values ``[..., HV, V]`` for ``value``) as the
        buffer stores and reads them back, in :attr:`dtype`, without storing them."""
        return (self._keys if part == "key" else self._values).rounded(x, self.dtype)

    def keys(self) -> torch.Tensor:
        """Stored keys, dequantised: ``[B, n, H, K]`` in :attr:`dtype`."""
        return self._keys.read(self._len, self.dtype)

    def values(self) -> torch.Tensor:
        """Stored delta values ``u``, dequantised: ``[B, n, HV, V]`` in :attr:`dtype`."""
        return self._values.read(self._len, self.dtype)

    def log_decays(self) -> torch.Tensor:
        """Stored log decays ``g``: ``[B, n, HV]`` in :attr:`dtype`."""
        return self._decays[:, : self._len].clone()

    def records(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys [B, n, H, K], values [B, n, HV, V], log decays [B, n, HV])`` in :attr:`dtype`, read-only
        views where the storage holds them so (valid until the next append or clear): the reference's
        per-token reads."""
        n = self._len
        return (self._keys.read(n, self.dtype, copy=False), self._values.read(n, self.dtype, copy=False),
                self._decays[:, :n])

    def stored(self, part: str) -> quant.PackedTensor | torch.Tensor:
        """The ``key`` or ``value`` records as stored (views, not copies): a :class:`pace_core.quant.PackedTensor`
        ``[B, capacity, heads, 1, length]`` for integer storage (each vector one row of value-axis groups, as it was
        quantised), else the float tensor ``[B, capacity, heads, length]``."""
        store = self._keys if part == "key" else self._values
        if store.spec is None:
            return store.data
        zero = None if store.zero is None else store.zero.unsqueeze(-2)
        return quant.PackedTensor(store.codes.unsqueeze(-2), store.scale.unsqueeze(-2), zero, store.spec,
                                  (*store.codes.shape[:-1], 1, store.length))

    def storage(self) -> dict[str, torch.Tensor]:
        """The live storage tensors (not copies), for kernels that write records in place (and a state pool's
        rows):
        ``keys`` (``[B, capacity, H, K]`` float, or ``[B, capacity, H, m]`` uint8 codes), ``key_scale``
        (``[B, capacity, H, K/g]`` fp16) and ``key_zero`` (uint8, with zero points) for integer keys,
        ``values`` / ``value_scale`` / ``value_zero`` likewise with HV and V, ``log_decays [B, capacity,
        HV]``. Codes are :mod:`pace_core.quant`'s packed codes of value-axis groups along each vector."""
        return {**self._keys.storage(), **self._values.storage(), "log_decays": self._decays}

    def masked_records(self, rows: torch.Tensor, counts: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
        """The first ``n`` record slots of ``rows`` (long ``[B]``), each row holding ``counts[b]`` records: ``(keys
        [B, n, H, K], delta values [B, n, HV, V], log decays [B, n, HV])`` in :attr:`dtype`, a slot beyond its
        row's count read as ``u = 0``, ``g = 0`` (it writes and decays nothing: pace_core.recurrence.Records)."""
        held = (torch.arange(n, device=counts.device)[None, :] < counts[:, None]).to(self.dtype)  # [B, n]
        us = self._values.read(n, self.dtype, rows=rows) * held[..., None, None]
        gs = self._decays[rows, :n].to(self.dtype) * held[..., None]
        return self._keys.read(n, self.dtype, rows=rows), us, gs

    def write_at(self, rows: torch.Tensor, at: torch.Tensor, k: torch.Tensor, u: torch.Tensor, g: torch.Tensor) -> None:
        """One record per row (``rows``, ``at`` long ``[B]``): ``k [B, H, K]``, ``u [B, HV, V]``, ``g [B, HV]`` at
        record ``at[b]`` of row ``rows[b]`` (finite; the caller checked them)."""
        self._keys.write_at(rows, at, k)
        self._values.write_at(rows, at, u)
        self._decays[rows, at] = g.to(self.dtype)

    def empty_rows(self, rows: torch.Tensor) -> None:
        """Forget every record of ``rows`` (long ``[n]``)."""
        self._decays[rows] = EMPTY

    def mark_appended(self, n: int = 1) -> None:
        """Count ``n`` records that a kernel wrote in place into slots ``len .. len + n - 1``."""
        if not isinstance(n, int) or n < 0 or self._len + n > self.capacity:
            raise PaceError(
                f"n: {n!r} not allowed; allowed: an integer 0..{self.capacity - self._len} (free slots)"
            )
        self._len += n

    def recount(self, n: int) -> None:
        """The count of records in the storage, set from outside: what a recorded CUDA graph's call left after
        its replay wrote them (:mod:`pace_core.graphs`)."""
        if not isinstance(n, int) or not 0 <= n <= self.capacity:
            raise PaceError(f"n: {n!r} not allowed; allowed: an integer 0..{self.capacity}")
        self._len = n

    def clear(self) -> None:
        """Forget all records (storage stays allocated; their log decays marked :data:`EMPTY`)."""
        self._decays[:, :self._len].fill_(EMPTY)
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
