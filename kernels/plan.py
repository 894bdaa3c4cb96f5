"""Launch planning of the decode kernels: the compile-time layout of a checkpoint's parts (per-head bit
widths), which shapes the kernels support, and :class:`DecodePlan`, everything a launch needs that does not
change from token to token.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from .primitives import KERNEL_BITS, zero_pairs
from .records import record_args, record_layout
from pace_core import quant
from pace_core.buffer import DecodeBuffer
from pace_core.errors import PaceError


Checkpoint = torch.Tensor | quant.PackedTensor | quant.MixedPackedState


@dataclass(frozen=True)
class PartLayout:
    """Compile-time layout of one bit width's part of a state (shared with the decode kernel)."""

    bits: int
    pack_zero: bool  # zero points read as nibble pairs (primitives.zero_pairs)
    code_cols: int   # bytes per row of codes
    scale_size: int  # fp16 scales per head
    zero_size: int   # bytes of zero points per head (0 when symmetric)


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
(no host-to-device copies per token), and a head map that is a kept table's reads back without a sync."""
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
        heads = {b: torch.tensor([h for h, x in enumerate(bits_per_head) if x == b], dtype=torch.int16,
                                 device=device) for b in widths}
        as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.clear()
        found = _TABLES[key] = (widths, HeadTable(as_i32(part), as_i32(slot), heads))
    return list(found[0]), found[1]


def bits_of_heads(heads: dict[int, torch.Tensor], hv: int) -> list[int]:
    """Bits of each of the ``hv`` value heads of a head map (bits -> head indices): from the kept table
    whose map it is (no device read), else read from the device."""
    for (bits, _), (_, table) in _TABLES.items():
        if len(bits) == hv and table.heads.keys() == heads.keys() and all(table.heads[b] is t for b, t in heads.items()):
            return list(bits)
    out = [0] * hv
    for b, t in heads.items():
        for h in t.tolist():
            out[h] = b
    return out


def layout_args(layouts: list[PartLayout]) -> dict:
    """Kernel constexprs for one or two parts (the second repeats the first when absent)."""
    l1 = layouts[1] if len(layouts) == 2 else layouts[0]
    return dict(
        BITS0=layouts[0].bits, PZ0=layouts[0].pack_zero, CC0=layouts[0].code_cols,
        SS0=layouts[0].scale_size, ZS0=layouts[0].zero_size,
        BITS1=l1.bits, PZ1=l1.pack_zero, CC1=l1.code_cols, SS1=l1.scale_size, ZS1=l1.zero_size,
        TWO=len(layouts) == 2,
    )


def part_pointers(parts: list[quant.PackedTensor]) -> list[torch.Tensor]:
    """codes, scale, zero of part 0 and part 1 (part 0 again when there is one part; the scale
    stands in for an absent zero point, which symmetric kernels never touch)."""
    p1 = parts[1] if len(parts) == 2 else parts[0]
    out = []
    for p in (parts[0], p1):
        out += [p.codes, p.scale, p.scale if p.zero is None else p.zero]
    return out


def as_mixed(ckpt: quant.PackedTensor | quant.MixedPackedState) -> quant.MixedPackedState:
    """``ckpt`` as a checkpoint of per-head bit widths (one part holding every head, for a single width)."""
    if isinstance(ckpt, quant.MixedPackedState):
        return ckpt
    bits = ckpt.spec.bits
    _, table = head_table([bits] * ckpt.shape[-3], ckpt.codes.device)  # the kept map: read back without a sync
    return quant.MixedPackedState({bits: ckpt}, {bits: table.heads[bits]}, ckpt.shape)


def packed_args(m: quant.MixedPackedState, shape: tuple[int, int, int, int]) -> tuple[list, list[PartLayout],
                                                                                     HeadTable]:
    """A packed checkpoint ``m`` of ``shape = (B, HV, K, V)`` checked for the decode kernels, and its kernel
    arguments: the head table's part and slot tensors, codes / scale / zero of part 0 and part 1
    (:func:`part_pointers`) and the value heads per sequence of each part; with the parts' layouts (ascending
    bit widths) and the head table."""
    B, HV, K, V = shape
    widths = sorted(m.parts)
    parts = [m.parts[w] for w in widths]
    if m.shape != shape:
        raise PaceError(f"ckpt: shape {m.shape} not allowed; allowed: {shape}")
    check_kernel_shape(K, V, parts[0].spec, "ckpt", decode=True, widths=tuple(widths))
    _, table = head_table(bits_of_heads({w: m.heads[w] for w in widths}, HV), parts[0].codes.device)
    ptrs = part_pointers(parts)
    if not all(t.is_contiguous() for t in ptrs):
        raise PaceError("ckpt: packed tensors must be contiguous; allowed: contiguous codes/scale/zero")
    hv1 = len(m.heads[widths[1]]) if len(widths) == 2 else 0
    args = [table.part, table.slot, *ptrs, len(m.heads[widths[0]]), hv1]
    return args, [part_layout(p.spec, K, V) for p in parts], table


def whole_groups(BV: int, V: int, G: int, key_axis: bool, sym: bool, pack_zero: bool) -> int:
    """``BV`` columns per program, or all ``V`` where a ``BV``-column tile would split a value-axis group of
    ``G`` (or a pair of packed zero points)."""
    return V if not key_axis and BV % (2 * G if not sym and pack_zero else G) else BV


def column_block(buf: DecodeBuffer) -> int:
    """Columns per program: all of V when the values are stored as integers (one scale per vector),
    else 64 (more programs at small batch)."""
    return buf.d_v if buf.precision == "int8" else min(buf.d_v, 64)


@dataclass
class DecodePlan:
    """Everything a decode launch needs that does not change from token to token: the checkpoint's
    storage pointers and head table, the tile sizes and compile-time layout. Built once per
    checkpoint/buffer pair (it reads the head map off the device), then reused, e.g. for every token
    of a CUDA graph; the checkpoint is updated in place, so the plan stays valid."""

    shape: tuple[int, int, int, int, int]  # B, H, HV, K, V
    precision: str
    capacity: int
    ckpt_args: list
    meta: dict = field(default_factory=dict)
    split: bool = False  # packed key-axis checkpoint: dots + record kernels, a separate flush kernel
    workspace_size: int = 0  # split: ``Ŝᵀk_t, Ŝᵀq_t`` ``[B*HV, 2, V]`` float32 between the two kernels (scratch)
    part_launches: list = field(default_factory=list)  # split, two bit widths: (args, PartLayout, heads) per width
    records: tuple = ()  # the buffer's record pointers (record_args: its storage stays allocated)
    record_meta: dict = field(default_factory=dict)  # their compile-time layout (record_layout)
    launches: dict = field(default_factory=dict)  # split: ckpt_launches by per_part
    gluon_dots: dict = field(default_factory=dict)  # split: per_part -> whether each dots launch runs gluon_dots
    gluon_flush: dict = field(default_factory=dict)  # split: per_part -> whether each flush launch runs gluon_flush
    gluon_step: bool = False  # split: whether the one-kernel step runs gluon_step
    device: torch.device = torch.device("cpu")

    @property
    def workspace(self) -> torch.Tensor:
        """The split step's workspace (``workspace_size`` float32 entries of :func:`scratch`)."""
        return scratch(self.device, self.workspace_size)

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


SPLIT_DEFAULTS = {"fused_step": "auto", "step_warps": 4, "dots_columns": 128, "dots_warps": 4, "record_warps": 1,
                  "flush_warps": 4, "flush_columns": 128, "dots_per_part": "auto", "per_part": "auto",
                  "gluon_dots": True, "gluon_flush": True, "gluon_step": True}
"""Launch settings of the split path (``DecodePlan.meta``; kernels/bench.py tries others, and these
are the fastest it measured on the H200 at batch 32 to 128, data/bench/bench.json): the step as one
kernel (``fused_step``, :func:`_ckpt_step_kernel`, with ``step_warps``) or as two (the dots kernel's
columns per program and warps, the record kernel's warps); ``"auto"`` fuses where the step runs
:mod:`kernels.gluon_step` (``gluon_step``, :func:`gluon_step_apply`: the dots and records of a head in one warp)
and otherwise when there are at most as many (sequence, value head) programs as the GPU has SMs: one wave,
where the launch saved outweighs the Triton step kernel's block-wide reductions (faster at batch 1-4 on the
H200, slower from 8). Then warps of the flush kernel and columns per flush program (4-bit codes: two half tiles of
``flush_columns / 2`` rows; on the GPU at least 16 for tensor-core tiles). ``gluon_dots``: a dots launch of
one 4-bit part runs :mod:`kernels.gluon_dots` on a GPU (off: the Triton kernel; at B = 128 on the H200 433
against 780 us per token for PACE-4, data/bench/bench.json). For two bit widths (:func:`ckpt_launches`): the
dots kernel (``dots_per_part``), the flush and the window kernels (``per_part``) launched once per width;
``"auto"``: when the (sequence, value head) programs are more than the SMs, so that the two launches do not
leave most SMs idle in turn (per width, PACE-4/8's 4-bit heads take the Gluon dots kernel: 807 against 1128
us at B = 128; in one wave one launch is faster); under the interpreter always, so that the tests run it.
``gluon_flush``: a flush launch of one 4-bit part with PACE-4's or PACE-4/8's buffer runs :mod:`kernels.gluon_flush`
on a GPU (off: the Triton kernel). ``gluon_step``: the one-kernel step of PACE-4 runs :mod:`kernels.gluon_step` on a GPU
(off: the Triton kernels)."""


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """SMs of CUDA ``device`` (read once per device: the dense step asks on every token)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_decode(ckpt: Checkpoint, buf: DecodeBuffer, exact_current: bool = True, launch: dict | None = None
                ) -> DecodePlan:
    """Validate ``ckpt`` against ``buf`` and prepare the launch (see :class:`DecodePlan`); ``exact_current``:
    the current token's output from its exact record (pace_core.recurrence.buffered_step); ``launch``: launch
    settings over the defaults (``BK`` at most K; kernels/bench.py tries others)."""
    B, H, HV, K, V = buf.batch, buf.num_k_heads, buf.num_v_heads, buf.d_k, buf.d_v
    if buf.precision == "fp64":
        raise PaceError("buffer precision: 'fp64' not supported by the kernels; allowed: fp32, bf16, int8, mixed")
    if isinstance(ckpt, torch.Tensor):
        check_kernel_shape(K, V, quant.QuantSpec(8, True, "key", 1), "ckpt", decode=True)
        if ckpt.shape != (B, HV, K, V) or ckpt.dtype not in (torch.float32, torch.bfloat16) or not ckpt.is_contiguous():
            raise PaceError(f"ckpt: dense checkpoint {tuple(ckpt.shape)} {ckpt.dtype} not allowed; "
                            f"allowed: contiguous float32/bfloat16 {(B, HV, K, V)}")
        layouts = [part_layout(quant.QuantSpec(8, True, "key", 1), K, V)]
        table = torch.zeros(1, dtype=torch.int32, device=ckpt.device)
        ckpt_args = [ckpt, table, table, *([ckpt] * 6), 0, 0]
        G, key_axis, sym, BK = 1, True, True, min(K, 32)
    else:
        m = as_mixed(ckpt)
        widths = sorted(m.parts)
        parts = [m.parts[w] for w in widths]
        spec = parts[0].spec
        args, layouts, table = packed_args(m, (B, HV, K, V))
        ckpt_args = [parts[0].scale, *args]
        G, key_axis, sym = spec.group_size, spec.axis == "key", spec.symmetric
        BK = min(max(G, 32) if key_axis else 32, K)
    BV = whole_groups(column_block(buf), V, G, key_axis, sym, layouts[0].pack_zero)
    st, records = record_args(buf)
    record_meta = record_layout(st)
    meta = dict(K=K, V=V, BK=BK, BV=BV, G=G, KEY_AXIS=key_axis, SYM=sym, **layout_args(layouts),
                DENSE=isinstance(ckpt, torch.Tensor), **record_meta, EXACT=exact_current,
                num_warps=8 if BK * BV >= 8192 else 4)
    split = not meta["DENSE"] and key_axis
    workspace_size = 0
    if split:  # bfloat16 tensor-core operands on a GPU (fp32 holding the same values under the interpreter)
        fusable = all((V // 2 if p.spec.bits == 4 else V) >= 16 for p in parts)  # no padded dot columns
        meta = {**meta, **SPLIT_DEFAULTS, "BF16": buf.device.type == "cuda", "fusable": fusable}
    if launch:
        meta = {**meta, **launch}
        meta["BK"] = min(meta["BK"], K)
    if split:
        one_wave = buf.device.type == "cuda" and B * HV <= sm_count(buf.device)
        for key in ("per_part", "dots_per_part"):
            if meta[key] == "auto":
                meta[key] = not one_wave
        workspace_size = B * HV * 2 * V
        scratch(buf.device, workspace_size)
    part_launches = []
    if split and len(layouts) == 2:
        for w, part, layout in zip(widths, parts, layouts):
            heads = table.heads[w]
            part_launches.append(([heads, heads, *part_pointers([part]), len(heads), len(heads)], layout, len(heads)))
    plan = DecodePlan((B, H, HV, K, V), buf.precision, buf.capacity, ckpt_args, meta, split, workspace_size,
                      part_launches, records, record_meta, device=buf.device)
    if split:
        plan.launches.update({per_part: ckpt_launches(plan, per_part) for per_part in (False, True)})
        for per_part in (False, True):
            commons = [common for _, common, _ in plan.launches[per_part]]
            plan.gluon_dots[per_part] = [gluon_dots_apply(plan, common) for common in commons]
            plan.gluon_flush[per_part] = [gluon_flush_apply(plan, common) for common in commons]
        plan.gluon_step = gluon_step_apply(plan)
        if plan.meta["fused_step"] == "auto":
            plan.meta["fused_step"] = plan.gluon_step or one_wave
    return plan


def _gluon_part(plan: DecodePlan, common: dict) -> bool:
    """What the Gluon kernels need of a launch: bfloat16 tensor-core operands (a GPU), one part of 4-bit codes
    (symmetric or with packed zero points) and 128-wide heads."""
    _, _, _, K, V = plan.shape
    return bool(common["BF16"] and not common["TWO"] and common["BITS0"] == 4 and (common["SYM"] or common["PZ0"])
                and K == 128 and V == 128)


def _gluon_dots_part(plan: DecodePlan, common: dict) -> bool:
    """What :func:`kernels.gluon_dots.head_dots` takes: :func:`_gluon_part` in key groups of whole 16-row steps."""
    return _gluon_part(plan, common) and common["G"] % 16 == 0


def gluon_dots_apply(plan: DecodePlan, common: dict) -> bool:
    """Whether a dots launch with constexprs ``common`` runs :mod:`kernels.gluon_dots`: :func:`_gluon_dots_part` and
    the plan's ``gluon_dots`` setting on."""
    return bool(plan.meta["gluon_dots"] and _gluon_dots_part(plan, common))


def _pace4_records(plan: DecodePlan) -> bool:
    """PACE-4's records: int8 keys and values, symmetric, one scale per vector, at most 16 of them."""
    _, _, _, K, V = plan.shape
    r = plan.record_meta
    return bool(r["KBITS"] == 8 and r["KSYM"] and r["KG"] == K and r["VBITS"] == 8 and r["VSYM"] and r["VG"] == V
                and plan.capacity <= 16)


def gluon_step_apply(plan: DecodePlan) -> bool:
    """Whether the one-kernel step runs :mod:`kernels.gluon_step`: one part of symmetric codes
    (:func:`_gluon_dots_part`), PACE-4's records (:func:`_pace4_records`) in 5 to 8 slots (a block of 8, the GPU
    test's), the exact current token, and the plan's ``gluon_step`` setting on."""
    common = plan.launches[False][0][1]
    return bool(plan.meta["gluon_step"] and _gluon_dots_part(plan, common) and common["SYM"] and _pace4_records(plan)
                and 4 < plan.capacity <= 8 and plan.meta["EXACT"])


def gluon_flush_apply(plan: DecodePlan, common: dict) -> bool:
    """Whether a flush launch with constexprs ``common`` runs :mod:`kernels.gluon_flush`: :func:`_gluon_part`, key
    groups of 16 to 64 rows, in one of the two formats checked on the GPU against the Triton kernel: PACE-4's
    (symmetric codes; int8 keys and values with one scale per vector, at most 16 records) or PACE-4/8's 4-bit heads
    (packed zero points; 4-bit keys in groups of 16 rows with packed zero points, bfloat16 values, at most 8
    records); and the plan's ``gluon_flush`` setting on."""
    r = plan.record_meta
    pace4 = common["SYM"] and _pace4_records(plan)
    pace48 = (not common["SYM"] and common["PZ0"] and r["KBITS"] == 4 and r["KG"] == 16 and not r["KSYM"]
              and r["KPZ"] and r["V_BF16"] and plan.capacity <= 8)
    return bool(plan.meta["gluon_flush"] and _gluon_part(plan, common) and common["G"] in (16, 32, 64)
                and (pace4 or pace48))


def ckpt_common(m: dict) -> dict:
    """The packed checkpoint's compile-time layout (the split kernels' common constexpr arguments)."""
    return dict(K=m["K"], V=m["V"], G=m["G"], SYM=m["SYM"], TWO=m["TWO"], BF16=m["BF16"], MAPPED=False,
                **{f"{x}{i}": m[f"{x}{i}"] for x in ("BITS", "PZ", "CC", "SS", "ZS") for i in (0, 1)})


def ckpt_launches(plan: DecodePlan, per_part: bool) -> list[tuple[list, dict, int]]:
    """``(checkpoint arguments, constexprs, value heads per sequence)`` of each launch of a split kernel.

    A checkpoint of two bit widths (PACE-4/8) is launched once per width (``per_part``) over that width's
    heads only (``MAPPED``: slot ``i`` of the part is value head ``heads[i]``), so each launch is compiled
    for one width: compiled for both, a kernel branches on the head's width and pays the larger register
    count and code size in every program (at B = 128 the per-width flush took 288 us against 377, the
    window 406 against 460, the dots 55 against 57, ``data/bench/v8_ncu``); in one wave two launches take
    longer than one. Otherwise one launch over all heads (``plan.ckpt_args[1:]``, the head table read where
    there are two widths)."""
    common = ckpt_common(plan.meta)
    if per_part and plan.part_launches:
        return [(args, {**common, **layout_args([layout]), "MAPPED": True}, heads)
                for args, layout, heads in plan.part_launches]
    return [(plan.ckpt_args[1:], common, plan.shape[2])]


def part_args(args: list) -> tuple:
    """``(head table, codes, fp16 scales, zero points)`` of part 0 in a launch's checkpoint arguments
    (:func:`ckpt_launches`): what the Gluon kernels, each launched on one part, read."""
    table, _, codes, scale, zero = args[:5]
    return table, codes, scale, zero


def output_tensor(out: torch.Tensor | None, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``out`` checked to be a contiguous float32 tensor of ``shape`` (PaceError naming what is allowed), or a new one
    on ``device`` when None."""
    if out is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    if tuple(out.shape) != shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise PaceError(f"out: {tuple(out.shape)} {out.dtype} not allowed; allowed: contiguous float32 {shape}")
    return out
