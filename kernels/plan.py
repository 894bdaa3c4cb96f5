"""Launch planning of the decode kernels: the compile-time layout of a checkpoint's parts (per-head bit
widths), which shapes the kernels support, and :class:`DecodePlan`, everything a launch needs that does not
change from token to token.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from pace_core import quant
from pace_core.buffer import DecodeBuffer
from pace_core.errors import PaceError

from .primitives import KERNEL_BITS, zero_pairs
from .records import Records
from .settings import Launch, SplitSettings

Checkpoint = torch.Tensor | quant.PackedTensor | quant.MixedPackedState


@dataclass(frozen=True)
class PartLayout:
    """Compile-time layout of one bit width's part of a state (shared with the decode kernel)."""

    bits: int
    pack_zero: bool  # zero points read as nibble pairs (primitives.zero_pairs)
    code_cols: int   # bytes per row of codes
    scale_size: int  # fp16 scales per head
    zero_size: int   # bytes of zero points per head (0 when symmetric)

    def constexprs(self, i: int) -> dict:
        """The kernels' constexprs of part ``i``: ``BITS{i}, PZ{i}, CC{i}, SS{i}, ZS{i}``."""
        return {f"BITS{i}": self.bits, f"PZ{i}": self.pack_zero, f"CC{i}": self.code_cols, f"SS{i}": self.scale_size,
                f"ZS{i}": self.zero_size}


def part_layout(spec: quant.QuantSpec, K: int, V: int) -> PartLayout:
    """Sizes per head of ``spec``'s storage for a ``[K, V]`` state (pace_core.quant's format)."""
    rows, per_row = quant.scale_shape((K, V), spec)
    zero_size = 0 if spec.symmetric else rows * quant.packed_last_dim(spec.bits, per_row)
    return PartLayout(spec.bits, zero_pairs(spec.bits, per_row), quant.packed_last_dim(spec.bits, V), rows * per_row,
                      zero_size)


def is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


DECODE_MIN_K = 16
"""The decode kernels' narrowest keys (a tensor-core tile): the flush at K = 8 gave wrong PACE-4/8
checkpoints on the H200 (kernels/NOTES.md, run 5), so narrower heads decode on the reference."""


WIDTH_REASON = ("the kernels read and write 3-, 4- and 8-bit codes only: 4 and 8 bits are PACE-4's and PACE-4/8's, "
                "3 bits PACE-3's (the frontier's fewest bits at a usable quality, its decode step reading 3/4 of "
                "PACE-4's code bytes: kernels/bench/NOTES.md); the other widths' densely packed codes (2, 5, 6, 7 "
                "bits) are unpacked by the PyTorch reference")
"""Why a configuration of another width runs on the reference (:func:`check_kernel_shape`)."""


def check_kernel_shape(K: int, V: int, spec: quant.QuantSpec, name: str = "x", decode: bool = False,
                       widths: tuple[int, ...] = ()) -> None:
    """Raise PaceError, saying why, unless the kernels support a ``[K, V]`` state with ``spec``'s groups and code
    widths (``spec.bits`` and ``widths``: :data:`kernels.primitives.KERNEL_BITS`; 3-bit codes in rows of whole
    24-bit words, V a multiple of 8, their zero points along the key axis) (``decode``: the buffered decode
    kernels, which also need ``K >= DECODE_MIN_K``)."""
    for bits in {spec.bits, *widths}:
        if bits not in KERNEL_BITS:
            raise PaceError(f"{name}: bits={bits} is not supported by the Triton kernels; allowed: "
                            f"{', '.join(map(str, KERNEL_BITS))} ({WIDTH_REASON})")
    if 3 in {spec.bits, *widths} and not spec.symmetric and spec.axis != "key":
        raise PaceError(f"{name}: 3-bit zero points along the value axis are not supported by the Triton kernels; "
                        "allowed: symmetric codes or key-axis groups (a row of value-axis zero points is shorter "
                        "than a 24-bit word: the PyTorch reference unpacks it)")
    if 3 in {spec.bits, *widths} and V % 8:
        raise PaceError(f"{name}: V={V} is not supported by the Triton kernels for 3-bit codes; allowed: V a "
                        "multiple of 8 (rows of whole 24-bit words)")
    quant.check_divides(spec.group_size, K if spec.axis == "key" else V, spec.axis, name)
    for what, n in (("K", K), ("V", V), ("group_size", spec.group_size)):
        if not is_pow2(n):
            raise PaceError(f"{name}: {what}={n} is not supported by the Triton kernels; allowed: powers of two")
    if V < 2:
        raise PaceError(f"{name}: V={V} is not supported by the Triton kernels; allowed: V >= 2")
    if decode and K < DECODE_MIN_K:
        raise PaceError(f"{name}: K={K} is not supported by the Triton decode kernels; allowed: K >= {DECODE_MIN_K} "
                        "(narrower heads decode on the PyTorch reference)")


def row_block(K: int, spec: quant.QuantSpec, V: int) -> int:
    """Rows per tile: whole key groups, about 4096 values per program."""
    rows = max(1, min(K, 4096 // V))
    if spec.axis == "key":
        rows = max(rows, spec.group_size)
    return rows


@dataclass
class HeadTable:
    """Which part (0 or 1) and which slot inside it each value head uses, as int32 device tensors."""

    part: torch.Tensor
    slot: torch.Tensor
    heads: dict[int, torch.Tensor]  # bits -> ascending int16 head indices (pace_core.quant.MixedPackedState's map)


_TABLES: dict[tuple[tuple[int, ...], torch.device], tuple[list[int], HeadTable]] = {}
"""Head tables by (bits per head, device), made once: every store and load of a layer reuses its table
(no host-to-device copies per token), and a head map that is a kept table's is known without a read
(:data:`_KNOWN_MAPS`)."""
_MAX_TABLES = 4096


def head_table(bits_per_head: list[int], device: torch.device) -> tuple[list[int], HeadTable]:
    """The distinct bit widths (ascending, at most two) and the head table for ``bits_per_head`` (kept:
    its tensors are shared, never written)."""
    key = (tuple(int(b) for b in bits_per_head), torch.device(device))
    found = _TABLES.get(key)
    if found is None:
        for b in bits_per_head:
            quant.check_bits(b, "bits_per_head")
        widths = sorted(set(bits_per_head))
        if len(widths) > 2:
            raise PaceError(f"bits_per_head: {widths} distinct widths not supported in one launch; allowed: at most 2")
        part = [widths.index(b) for b in bits_per_head]
        slot = [sum(1 for p in part[:h] if p == part[h]) for h in range(len(part))]
        heads = {b: quant.heads_at(key[0], b, key[1]).to(torch.int16) for b in widths}
        as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.clear()
        found = _TABLES[key] = (widths, HeadTable(as_i32(part), as_i32(slot), heads))
        _remember_map(heads, list(key[0]))
    return list(found[0]), found[1]


_KNOWN_MAPS: dict[tuple[int, ...], tuple[dict[int, torch.Tensor], list[int]]] = {}
"""The bits per head of head maps known on the host (the kept tables' maps, and checkpoints' maps read from the device
once), by the identities of their tensors (kept alive here, so an identity is never another map's): a checkpoint's
later plans, e.g. inside a CUDA graph's capture, know its bits without a read."""


def _remember_map(heads: dict[int, torch.Tensor], bits: list[int]) -> None:
    if len(_KNOWN_MAPS) >= _MAX_TABLES:
        _KNOWN_MAPS.clear()
    _KNOWN_MAPS[tuple(id(t) for t in heads.values())] = (dict(heads), bits)


def bits_of_heads(heads: dict[int, torch.Tensor], hv: int) -> list[int]:
    """Bits of each of the ``hv`` value heads of a head map (bits -> head indices): known on the host when the map is
    a kept table's or was read before (:data:`_KNOWN_MAPS`), else read from the device once."""
    found = _KNOWN_MAPS.get(tuple(id(t) for t in heads.values()))
    if found is not None and found[0].keys() == heads.keys() and all(found[0][b] is t for b, t in heads.items()):
        return list(found[1])
    out = [0] * hv
    for b, t in heads.items():
        for h in t.tolist():
            out[h] = b
    _remember_map(heads, out)
    return list(out)


@dataclass(frozen=True)
class PartStorage:
    """One bit width's storage as a kernel takes it: ``codes [B, HP, K, CC]`` uint8, ``scale [B, HP, ...]`` fp16
    (``SS`` per head), ``zero [B, HP, ...]`` uint8 zero points (``ZS`` bytes per head; the scale tensor where the codes
    are symmetric: never read), and its :class:`PartLayout`."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    layout: PartLayout

    @classmethod
    def of(cls, p: quant.PackedTensor, K: int, V: int) -> PartStorage:
        return cls(p.codes, p.scale, p.scale if p.zero is None else p.zero, part_layout(p.spec, K, V))

    def pointers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.codes, self.scale, self.zero


@dataclass(frozen=True)
class CkptArgs:
    """A checkpoint as one launch takes it: the head table ``table [HV]`` int32 (the part of value head ``h``; with
    ``mapped``, a launch over one part's heads, ``table [HP]`` holds the value head of each slot of the part) and
    ``slot [HV]`` int32 (``h``'s slot in its part), part 0 and part 1 (part 0 again where there is one width), the
    value heads per sequence of each part as the kernels take them (``HV0, HV1``), and whether the heads have
    ``two`` widths (read through the table). The kernels take it as ``table, slot, codes, scale, zero of part 0 and
    of part 1, HV0, HV1`` (:meth:`args`) and the constexprs of :meth:`constexprs`."""

    table: torch.Tensor
    slot: torch.Tensor
    parts: tuple[PartStorage, PartStorage]
    heads: tuple[int, int]
    two: bool
    mapped: bool = False

    @classmethod
    def of_parts(cls, table: torch.Tensor, slot: torch.Tensor, parts: list[PartStorage], heads: tuple[int, int],
                 mapped: bool = False) -> CkptArgs:
        """One or two parts (ascending bit widths), part 0 standing in for an absent part 1."""
        return cls(table, slot, (parts[0], parts[-1]), heads, len(parts) == 2, mapped)

    @classmethod
    def dense(cls, state: torch.Tensor, table: torch.Tensor) -> CkptArgs:
        """A dense state's stand-in (a kernel compiled with ``DENSE`` reads no part or table): ``state`` for every
        pointer of the parts, ``table`` for the head table's, no heads."""
        part = PartStorage(state, state, state, part_layout(quant.QuantSpec(8, True, "key", 1), *state.shape[-2:]))
        return cls(table, table, (part, part), (0, 0), False)

    def pointers(self) -> tuple[torch.Tensor, ...]:
        """``table, slot`` and each part's ``codes, scale, zero``."""
        return (self.table, self.slot, *self.parts[0].pointers(), *self.parts[1].pointers())

    def args(self) -> tuple:
        """:meth:`pointers` then ``HV0, HV1``."""
        return (*self.pointers(), *self.heads)

    def constexprs(self) -> dict:
        """The parts' layouts (``BITS0 .. ZS1``, :meth:`PartLayout.constexprs`) and ``TWO``."""
        return {**self.parts[0].layout.constexprs(0), **self.parts[1].layout.constexprs(1), "TWO": self.two}


def as_mixed(ckpt: quant.PackedTensor | quant.MixedPackedState) -> quant.MixedPackedState:
    """``ckpt`` as a checkpoint of per-head bit widths (one part holding every head, for a single width)."""
    if isinstance(ckpt, quant.MixedPackedState):
        return ckpt
    bits = ckpt.spec.bits
    _, table = head_table([bits] * ckpt.shape[-3], ckpt.codes.device)  # the kept map: read back without a sync
    return quant.MixedPackedState({bits: ckpt}, {bits: table.heads[bits]}, ckpt.shape)


def packed_ckpt(m: quant.MixedPackedState, shape: tuple[int, int, int, int]) -> tuple[CkptArgs, HeadTable]:
    """A packed checkpoint ``m`` of ``shape = (B, HV, K, V)`` checked for the decode kernels (shape, kernel limits,
    contiguous storage), as one launch over all its heads takes it (through the head table; the second part's heads
    0 where there is one width), with its head table."""
    B, HV, K, V = shape
    widths = sorted(m.parts)
    parts = [m.parts[w] for w in widths]
    if m.shape != shape:
        raise PaceError(f"ckpt: shape {m.shape} not allowed; allowed: {shape}")
    check_kernel_shape(K, V, parts[0].spec, "ckpt", decode=True, widths=tuple(widths))
    _, table = head_table(bits_of_heads({w: m.heads[w] for w in widths}, HV), parts[0].codes.device)
    storage = [PartStorage.of(p, K, V) for p in parts]
    if not all(t.is_contiguous() for part in storage for t in part.pointers()):
        raise PaceError("ckpt: packed tensors must be contiguous; allowed: contiguous codes/scale/zero")
    hv1 = len(m.heads[widths[1]]) if len(widths) == 2 else 0
    return CkptArgs.of_parts(table.part, table.slot, storage, (len(m.heads[widths[0]]), hv1)), table


def whole_groups(BV: int, V: int, G: int, key_axis: bool, sym: bool, pack_zero: bool) -> int:
    """``BV`` columns per program, or all ``V`` where a ``BV``-column tile would split a value-axis group of
    ``G`` (or a pair of packed zero points)."""
    return V if not key_axis and BV % (2 * G if not sym and pack_zero else G) else BV


def column_block(buf: DecodeBuffer) -> int:
    """Columns per program: all of V when the values are stored as integers (one scale per vector),
    else 64 (more programs at small batch)."""
    return buf.d_v if buf.precision == "int8" else min(buf.d_v, 64)


@dataclass(frozen=True)
class SplitLaunch:
    """One launch of a split kernel (dots, window, flush): its checkpoint arguments (``ckpt.mapped``: over one bit
    width's heads), the value heads per sequence it covers (the grid's ``B * heads``), and whether its dots and its
    flush run the Gluon kernels (:func:`gluon_dots_apply`, :func:`gluon_flush_apply`)."""

    ckpt: CkptArgs
    heads: int
    gluon_dots: bool = False
    gluon_flush: bool = False


@dataclass(frozen=True)
class SplitPlan:
    """The split path of a packed key-axis checkpoint (PACE-4, PACE-4/8): the launch settings with every ``"auto"``
    decided (:meth:`kernels.settings.SplitSettings.resolved`), the tensor-core operands (``bf16``: bfloat16 on a
    GPU; float32 holding the same values under the interpreter), the key groups' rows ``group`` and symmetry,
    whether the heads are wide enough for the one-kernel step (``fusable``: no padded dot columns), the launches
    (``launches[per_part]``: one over all heads, or one per bit width, :func:`split_launches`), whether the
    one-kernel step runs :mod:`kernels.gluon_step`, the ``[B*HV, 2, V]`` float32 workspace of the dots kernel, and
    whether a state pool's Gluon step folds the slots it fills (:func:`step_folds_apply`)."""

    settings: SplitSettings
    bf16: bool
    group: int
    symmetric: bool
    fusable: bool
    launches: tuple[tuple[SplitLaunch, ...], tuple[SplitLaunch, ...]]
    gluon_step: bool
    workspace_size: int
    step_folds: bool = False

    def constexprs(self, launch: SplitLaunch, K: int, V: int) -> dict:
        """The split kernels' common constexprs for ``launch``: the head shape, the key groups, the operands'
        precision, the parts' layouts and whether the launch is mapped."""
        return dict(K=K, V=V, G=self.group, SYM=self.symmetric, BF16=self.bf16, MAPPED=launch.ckpt.mapped,
                    **launch.ckpt.constexprs())

    @property
    def dots(self) -> tuple[SplitLaunch, ...]:
        """The dots kernel's launches (``dots_per_part``)."""
        return self.launches[self.settings.dots_per_part]

    @property
    def per_width(self) -> tuple[SplitLaunch, ...]:
        """The flush's and the window's launches (``per_part``)."""
        return self.launches[self.settings.per_part]


@dataclass(frozen=True)
class FusedPlan:
    """The one-kernel step of a dense or value-axis checkpoint (:mod:`kernels.fused_step`): the dense state
    ``[B, HV, K, V]`` (for a packed checkpoint a stand-in never read), the checkpoint's arguments, ``rows`` key rows
    and ``columns`` value columns per tile, the groups (``group`` entries, along the keys with ``key_axis``,
    ``symmetric``), whether the state is ``dense``, and the warps."""

    state: torch.Tensor
    ckpt: CkptArgs
    rows: int
    columns: int
    group: int
    key_axis: bool
    symmetric: bool
    dense: bool
    num_warps: int


@dataclass(frozen=True)
class DecodePlan:
    """Everything a decode launch needs that does not change from token to token, for one checkpoint / buffer pair:
    the shape ``(B, H, HV, K, V)``, the buffer's precision and capacity, whether the current token's output uses its
    exact record (``exact``), the buffer's storage (:class:`kernels.records.Records`), and either the split path's
    plan (packed key-axis checkpoints) or the one-kernel step's. Built once (it reads the head map off the device),
    then reused, e.g. for every token of a CUDA graph: the checkpoint and the buffer are updated in place."""

    shape: tuple[int, int, int, int, int]
    precision: str
    capacity: int
    exact: bool
    records: Records
    device: torch.device
    split: SplitPlan | None = None
    fused: FusedPlan | None = None

    @property
    def workspace(self) -> torch.Tensor:
        """The split step's workspace (``workspace_size`` float32 entries of :func:`scratch`)."""
        return scratch(self.device, self.split.workspace_size)

    @property
    def record_block(self) -> int:
        """Records read per block by :func:`kernels.records.record_reads`: the buffer's capacity rounded up to a
        power of two, at most 16."""
        return min(1 << max(self.capacity - 1, 0).bit_length(), 16)


_SCRATCH: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # kept alive: a CUDA graph captured on one may still be replayed


def scratch(device: torch.device, numel: int) -> torch.Tensor:
    """``numel`` float32 entries on ``device`` shared by every launch plan (the layers of a model run one after
    another on a stream): a transient of the largest layer's size (pace_core.accounting's peak transient), not
    part of any layer's state. It grows when a larger one is asked for, never while a CUDA graph is captured on
    it (plans are made before capture)."""
    found = _SCRATCH.get(device)
    if found is None or found.numel() < numel:
        if found is not None:
            _OUTGROWN.append(found)
        found = _SCRATCH[device] = torch.empty(numel, dtype=torch.float32, device=device)
    return found[:numel]


@functools.cache
def sm_count(device: torch.device) -> int:
    """SMs of CUDA ``device`` (read once per device: the dense step asks on every token)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_decode(ckpt: Checkpoint, buf: DecodeBuffer, exact_current: bool = True, launch: Launch | None = None, *,
                bf16: bool | None = None, batch: int | None = None) -> DecodePlan:
    """Validate ``ckpt`` against ``buf`` and prepare the launches (see :class:`DecodePlan`). ``ckpt``: a dense state
    ``[B, HV, K, V]`` float32 / bfloat16 contiguous or a packed checkpoint of that shape (one or two bit widths);
    ``exact_current``: the current token's output from its exact record (pace_core.recurrence.buffered_step);
    ``launch``: the launch settings (:class:`kernels.settings.Launch`; kernels/bench/bench.py tries others);
    ``bf16``: the split path's tensor-core operands in bfloat16 (None: on a GPU; kernels/bench/sass.py compiles the
    GPU's kernels from CPU tensors); ``batch``: the sequences a launch steps, where not ``ckpt``'s (a state pool's
    first slot planned for the pool: the launch settings that depend on it)."""
    launch = launch or Launch()
    B, H, HV, K, V = buf.batch, buf.num_k_heads, buf.num_v_heads, buf.d_k, buf.d_v
    if buf.precision == "fp64":
        raise PaceError("buffer precision: 'fp64' not supported by the kernels; allowed: fp32, bf16, int8, mixed")
    common = dict(shape=(B, H, HV, K, V), precision=buf.precision, capacity=buf.capacity, exact=exact_current,
                  records=Records.of(buf), device=buf.device)
    dense = isinstance(ckpt, torch.Tensor)
    if dense:
        check_kernel_shape(K, V, quant.QuantSpec(8, True, "key", 1), "ckpt", decode=True)
        if ckpt.shape != (B, HV, K, V) or ckpt.dtype not in (torch.float32, torch.bfloat16) or not ckpt.is_contiguous():
            raise PaceError(f"ckpt: dense checkpoint {tuple(ckpt.shape)} {ckpt.dtype} not allowed; "
                            f"allowed: contiguous float32/bfloat16 {(B, HV, K, V)}")
        args = CkptArgs.dense(ckpt, torch.zeros(1, dtype=torch.int32, device=ckpt.device))
        G, key_axis, sym, rows, state = 1, True, True, min(K, 32), ckpt
    else:
        m = as_mixed(ckpt)
        args, table = packed_ckpt(m, (B, HV, K, V))
        spec = m.parts[min(m.parts)].spec
        G, key_axis, sym = spec.group_size, spec.axis == "key", spec.symmetric
        rows, state = min(max(G, 32) if key_axis else 32, K), args.parts[0].scale
    if dense or not key_axis:
        BV = whole_groups(column_block(buf), V, G, key_axis, sym, args.parts[0].layout.pack_zero)
        f = launch.fused
        warps = f.num_warps if f.num_warps is not None else (8 if rows * BV >= 8192 else 4)
        rows = min(f.rows if f.rows is not None else rows, K)
        return DecodePlan(**common, fused=FusedPlan(state, args, rows, BV, G, key_axis, sym, dense, warps))
    one_wave = buf.device.type == "cuda" and (batch or B) * HV <= sm_count(buf.device)
    split = SplitPlan(launch.split, buf.device.type == "cuda" if bf16 is None else bf16, G, sym,
                      all((V // 2 if p.spec.bits == 4 else V) >= 16 for p in m.parts.values()), ((), ()), False,
                      B * HV * 2 * V)
    scratch(buf.device, split.workspace_size)
    plan = DecodePlan(**common, split=split)
    launches = split_launches(plan, args, m, table)
    split = replace(split, launches=launches)
    gluon_step = gluon_step_apply(replace(plan, split=split))
    split = replace(split, gluon_step=gluon_step, settings=launch.split.resolved(one_wave, gluon_step))
    split = replace(split, step_folds=step_folds_apply(split))
    check_flush_tile(split, plan.records.layout.constexprs()["KG"], V)
    return replace(plan, split=split)


def check_flush_tile(split: SplitPlan, key_group: int, V: int) -> None:
    """PaceError for a Triton flush launch that folds wrong checkpoints on the GPU. Where the key records' groups are
    narrower than the flush's tile of key rows (``max(G, 16)``; one dot per group) with tensor-core operands, only the
    default layout is right: a program over the head's ``V`` columns with 4 warps, whose fold compiles to wgmma. The
    other layouts compile it to mma.sync and fold wrong (PACE-4/8: key records in groups of 16, tiles of 32 rows);
    PACE-4's mma.sync folds (one group per tile) are right. kernels/bench/NOTES.md "The flush fault" has the
    evidence; tests/test_kernels_decode.py::test_the_flush_folds_alike_at_every_column_width shows it on a GPU."""
    rows = max(split.group, 16)
    s = split.settings
    if split.bf16 and key_group < rows and (s.flush_columns < V or s.flush_warps != 4):
        raise PaceError(f"launch settings flush_columns={s.flush_columns}, flush_warps={s.flush_warps} not allowed "
                        f"where key records come in groups of {key_group} rows, narrower than the flush's tiles of "
                        f"{rows}: its flush folds wrong checkpoints on the GPU; allowed: flush_columns >= {V} with "
                        "flush_warps=4")


def split_launches(plan: DecodePlan, args: CkptArgs, m: quant.MixedPackedState, table: HeadTable
                   ) -> tuple[tuple[SplitLaunch, ...], tuple[SplitLaunch, ...]]:
    """The split kernels' launches: one over all heads (``args``, the head table read where there are two widths),
    and one per bit width (each over that width's heads only, ``mapped``: slot ``i`` of the part is value head
    ``heads[i]``), so that each launch is compiled for one width: compiled for both, a kernel branches on the head's
    width and pays the larger register count and code size in every program (at B = 128 the per-width flush took
    288 us against 377, the window 406 against 460, the dots 55 against 57,
    ``git show 5dab257:data/bench/v8_ncu/ncu_summary.json``); in one wave two launches take longer than one. With
    one width both are the one launch. Each launch knows whether its dots and its flush run the Gluon kernels
    (:func:`gluon_dots_apply`, :func:`gluon_flush_apply`)."""
    _, _, HV, K, V = plan.shape

    def made(ckpt: CkptArgs, heads: int) -> SplitLaunch:
        bare = SplitLaunch(ckpt, heads)
        return replace(bare, gluon_dots=gluon_dots_apply(plan, bare), gluon_flush=gluon_flush_apply(plan, bare))

    one = (made(args, HV),)
    if not args.two:
        return one, one
    per_width = []
    for w in sorted(m.parts):
        heads = table.heads[w]
        part = PartStorage.of(m.parts[w], K, V)
        per_width.append(made(CkptArgs.of_parts(heads, heads, [part], (len(heads), len(heads)), mapped=True),
                              len(heads)))
    return one, tuple(per_width)


def _gluon_part(plan: DecodePlan, launch: SplitLaunch) -> bool:
    """What the Gluon kernels need of a launch: bfloat16 tensor-core operands (a GPU), one part of 4-bit codes
    (symmetric or with packed zero points) and 128-wide heads."""
    _, _, _, K, V = plan.shape
    part = launch.ckpt.parts[0].layout
    return bool(plan.split.bf16 and not launch.ckpt.two and part.bits == 4
                and (plan.split.symmetric or part.pack_zero) and K == 128 and V == 128)


def _gluon_dots_part(plan: DecodePlan, launch: SplitLaunch) -> bool:
    """What :func:`kernels.gluon_dots.head_dots` takes: :func:`_gluon_part` in key groups of whole 16-row steps."""
    return _gluon_part(plan, launch) and plan.split.group % 16 == 0


def gluon_dots_apply(plan: DecodePlan, launch: SplitLaunch) -> bool:
    """Whether the dots ``launch`` runs :mod:`kernels.gluon_dots`: :func:`_gluon_dots_part` and the setting
    ``gluon_dots`` on."""
    return bool(plan.split.settings.gluon_dots and _gluon_dots_part(plan, launch))


def _pace4_records(plan: DecodePlan) -> bool:
    """PACE-4's records: int8 keys and values, symmetric, one scale per vector, at most 16 of them."""
    _, _, _, K, V = plan.shape
    k, v = plan.records.layout.keys, plan.records.layout.values
    return bool(k.bits == 8 and k.symmetric and k.group == K and v.bits == 8 and v.symmetric and v.group == V
                and plan.capacity <= 16)


def gluon_step_apply(plan: DecodePlan) -> bool:
    """Whether the one-kernel step runs :mod:`kernels.gluon_step`: one part of symmetric codes
    (:func:`_gluon_dots_part`), PACE-4's records (:func:`_pace4_records`) in 5 to 8 slots (a block of 8, the GPU
    test's), the exact current token, and the setting ``gluon_step`` on."""
    return bool(plan.split.settings.gluon_step and _gluon_dots_part(plan, plan.split.launches[False][0])
                and plan.split.symmetric and _pace4_records(plan) and 4 < plan.capacity <= 8 and plan.exact)


def step_folds_apply(split: SplitPlan) -> bool:
    """Whether a state pool's Gluon step also folds the slots its token fills (setting ``step_folds``): the Gluon
    step at one warp per head, over one launch that the Gluon flush takes (its fold runs in the step's programs)."""
    return bool(split.settings.step_folds and split.gluon_step and split.settings.gluon_step_warps == 1
                and len(split.per_width) == 1 and split.per_width[0].gluon_flush)


def gluon_flush_apply(plan: DecodePlan, launch: SplitLaunch) -> bool:
    """Whether the flush ``launch`` runs :mod:`kernels.gluon_flush`: :func:`_gluon_part`, key groups of 16 to 64 rows,
    in one of the two formats checked on the GPU against the Triton kernel: PACE-4's (symmetric codes; int8 keys and
    values with one scale per vector, at most 16 records) or PACE-4/8's 4-bit heads (packed zero points; 4-bit keys
    in groups of 16 rows with packed zero points, bfloat16 values, at most 8 records); and the setting
    ``gluon_flush`` on."""
    k, v = plan.records.layout.keys, plan.records.layout.values
    sym = plan.split.symmetric
    pace4 = sym and _pace4_records(plan)
    pace48 = (not sym and launch.ckpt.parts[0].layout.pack_zero and k.bits == 4 and k.group == 16
              and not k.symmetric and k.packed_zero and v.bf16 and plan.capacity <= 8)
    return bool(plan.split.settings.gluon_flush and _gluon_part(plan, launch) and plan.split.group in (16, 32, 64)
                and (pace4 or pace48))


def output_tensor(out: torch.Tensor | None, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``out`` checked to be a contiguous float32 tensor of ``shape`` (PaceError naming what is allowed), or a new one
    on ``device`` when None."""
    if out is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    if tuple(out.shape) != shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise PaceError(f"out: {tuple(out.shape)} {out.dtype} not allowed; allowed: contiguous float32 {shape}")
    return out
