"""The dots kernel of 4-bit packed key-axis checkpoints in Gluon (explicit layouts, GPU only): ``Ŝᵀk_t, Ŝᵀq_t``
with no shared-memory staging of the codes.

One warp per (sequence, value head). The checkpoint's codes are read as 32-bit words (8 codes of one key row)
straight into the registers of a tensor-core A operand: words ``W [16, 16]`` (16 words of a row = the 128
values, 16 key rows per step) in the layout of ``mma.m16n8k16``'s A fragment, so that each thread holds the
words of two consecutive key rows for the same columns; one inline-PTX group (:func:`_planes`) turns two such
words into the 8 code planes ``A_m [16, 16]`` (``m``: the code's place in the word, value column ``8 i + m`` of
row ``i``) as bfloat16 ``c - offset`` pairs, exact. ``B [16, 8]`` holds ``k`` and ``q`` split into three
bfloat16 terms each (:func:`kernels.primitives.bf16_split`'s arithmetic), columns 0-2 and 4-6, from shared memory;
``A_m B`` on tensor cores accumulates per key group with fp32 sums, then the group's fp16 scale of each column
multiplies it. Every product is exact; the sums are fp32 in another order than the reference's (the Triton
kernel's tolerance, :mod:`kernels.backend`).

:func:`launch` is called by :func:`kernels.packed_step.launch_dots` for launches of one 4-bit part on CUDA
tensors (:func:`kernels.plan.gluon_dots_apply`, decided once per plan); the Triton kernel stays the definition
of the step and runs everywhere else.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .plan import DecodePlan, SplitLaunch
from .primitives import bf16_split, part_head

MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
"""The accumulators' layout: ``mma.m16n8k16`` of one warp."""
LA = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA.value, k_width=2))
LB = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA.value, k_width=2))
"""Its A and B operands' layouts (bfloat16 pairs along the reduction)."""
_SMEM = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0, 1]))

_PLANES = gl.constexpr("{\n.reg .b32 t, s;\n" + "".join(
    f"prmt.b32 t, $8, $9, 0x{4 + b}{4 + b}{b}{b};\n"
    f"lop3.b32 ${2 * b}, t, 0x000F000F, 0x43004300, 0xEA;\n"
    "shr.b32 s, t, 4;\n"
    f"lop3.b32 ${2 * b + 1}, s, 0x000F000F, 0x43004300, 0xEA;\n" for b in range(4)) + "}")
"""Two words (the same 8 columns of key rows r and r + 1) -> 8 bfloat16 pairs ``(128 + c[r], 128 + c[r+1])``, one
per code place: ``prmt`` puts byte ``b`` of each word into the two halves, the mask keeps the low nibble (place
2b) or, after a shift, the high one (place 2b + 1), or-ed into the bits of 128.0."""


@gluon.jit
def _planes(w):
    """The 8 code planes of the words ``w`` (int32, A-operand layout, pairs of consecutive key rows in one
    thread): bfloat16 ``128 + c`` of the code at place ``m`` of each word, ``m = 0 .. 7``."""
    return gl.inline_asm_elementwise(_PLANES, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [w],
                                     (gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16,
                                      gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16), True, 2)


@gluon.jit
def _limb_tile(k_at, q_at, K: gl.constexpr, W: gl.constexpr = 1):
    """``[K, 8]`` fp32: ``k`` and ``q`` (``[K]`` at ``k_at``, ``q_at``) as three bfloat16-exact terms each
    (:func:`kernels.primitives.bf16_split`), columns 0-2 and 4-6, columns 3 and 7 zero: each product's terms in
    the columns of two lanes of the accumulator's quads (:func:`products`); rows spread over ``W`` warps."""
    LIMBS: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [W, 1], [1, 0])
    rows = gl.arange(0, K, layout=gl.SliceLayout(1, LIMBS))
    n = gl.arange(0, 8, layout=gl.SliceLayout(0, LIMBS))[None, :]
    out = gl.zeros([K, 8], gl.float32, LIMBS)
    for v in gl.static_range(2):
        if v == 0:
            x = gl.load(k_at + rows)
        else:
            x = gl.load(q_at + rows)
        hi, mid, lo = bf16_split(x)
        out = gl.where(n == 4 * v, hi[:, None], out)
        out = gl.where(n == 4 * v + 1, mid[:, None], out)
        out = gl.where(n == 4 * v + 2, lo[:, None], out)
    return out


@gluon.jit
def _scaled(acc, final, s_at, m: gl.constexpr):
    """``final + s acc`` with ``s`` the fp16 scales of the accumulator's rows ``i`` (value column ``8 i + m``)."""
    i = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    s = gl.load(s_at + 8 * i + m).to(gl.float32)
    return final + s[:, None] * acc


@gluon.jit
def products(f):
    """``[M, 2]``: ``Ŝᵀk`` (columns 0-3 of the accumulator ``f [M, 8]`` summed) and ``Ŝᵀq`` (4-7) of its rows: a
    sum in the thread and one shuffle, the four columns being those of two lanes."""
    return gl.sum(gl.reshape(f, [f.shape[0], 2, 4]), axis=2)


@gluon.jit
def _store(final, y_at, m: gl.constexpr, V: gl.constexpr):
    """``Ŝᵀk`` and ``Ŝᵀq`` (:func:`products`) of value columns ``8 i + m`` into ``y_at [2, V]``."""
    p = products(final)
    i = gl.arange(0, 16, layout=gl.SliceLayout(1, p.type.layout))[:, None]
    s = gl.arange(0, 2, layout=gl.SliceLayout(0, p.type.layout))[None, :]
    gl.store(y_at + s * V + 8 * i + m, p)


@gluon.jit
def _zero_offset(zw, m: gl.constexpr):
    """bfloat16 ``128 + z`` of code place ``m`` from the zero-point words ``zw`` (int32, 8 nibbles)."""
    return (((zw >> (4 * m)) & 15) + 128).to(gl.float32).to(gl.bfloat16)


@gluon.jit
def _offsets(zero_at, g: gl.constexpr, SYM: gl.constexpr, NW: gl.constexpr):
    """What each code plane subtracts in key group ``g``, bfloat16 ``128 + z`` broadcast over a step's ``[16, 16]``:
    ``z = 8`` (symmetric 4-bit codes) or the group's zero point of value column ``8 i + m`` (packed two per byte
    like the codes, so word ``i`` of the group's zero row holds those of row ``i``'s 8 columns)."""
    if SYM:
        o = gl.full([16, 16], 136.0, gl.bfloat16, LA)
        o0, o1, o2, o3, o4, o5, o6, o7 = o, o, o, o, o, o, o, o
    else:
        i = gl.arange(0, 16, layout=gl.SliceLayout(1, LA))
        zw = gl.load(zero_at.to(gl.pointer_type(gl.int32)) + g * NW + i)[:, None] + gl.zeros([16, 16], gl.int32, LA)
        o0, o1, o2, o3 = _zero_offset(zw, 0), _zero_offset(zw, 1), _zero_offset(zw, 2), _zero_offset(zw, 3)
        o4, o5, o6, o7 = _zero_offset(zw, 4), _zero_offset(zw, 5), _zero_offset(zw, 6), _zero_offset(zw, 7)
    return o0, o1, o2, o3, o4, o5, o6, o7


@gluon.jit
def _put(t, s: gl.constexpr, x):
    """The 8-tuple ``t`` with ``x`` at place ``s``."""
    return (x if s == 0 else t[0], x if s == 1 else t[1], x if s == 2 else t[2], x if s == 3 else t[3],
            x if s == 4 else t[4], x if s == 5 else t[5], x if s == 6 else t[6], x if s == 7 else t[7])


@gluon.jit
def head_dots(k_at, q_at, codes_at, scale_at, zero_at, K: gl.constexpr, V: gl.constexpr, G: gl.constexpr,
              SYM: gl.constexpr, AHEAD: gl.constexpr = 8):
    """``Ŝᵀk_t, Ŝᵀq_t`` of one head (one warp): its codes (``K`` key rows of ``V / 8`` 32-bit words at
    ``codes_at``), fp16 scales and zero-point bytes at ``scale_at``, ``zero_at``; ``k, q [K]`` fp32 at ``k_at``,
    ``q_at``. Returns the 8 accumulators ``f_m [16, 8]`` (:data:`MMA`): row ``i`` is value column ``8 i + m``,
    columns 0-2 the three terms of ``Ŝᵀk``, 4-6 those of ``Ŝᵀq`` (:func:`products`). The words of ``AHEAD`` 16-row
    steps are requested before the ``k, q`` terms are formed (all 8: 64 registers of words per thread), each later
    step's when the step ``AHEAD`` before it is taken (fewer registers, more warps per SM)."""
    NW: gl.constexpr = V // 8  # 32-bit words per key row
    STEPS: gl.constexpr = K // 16
    PER_GROUP: gl.constexpr = G // 16
    gl.static_assert(NW == 16, "a step's A operand is one key row of 16 words: V = 128")
    gl.static_assert(STEPS == 8, "8 steps of 16 key rows: K = 128")
    gl.static_assert(G % 16 == 0, "key groups of whole 16-row steps")
    i = gl.arange(0, 16, layout=gl.SliceLayout(1, LA))[:, None]
    r = gl.arange(0, 16, layout=gl.SliceLayout(0, LA))[None, :]
    at = codes_at.to(gl.pointer_type(gl.int32)) + r * NW + i  # step 0's [16 words, 16 rows]
    if AHEAD >= STEPS:  # every step's words requested at once: 8 KB per warp in flight
        steps = (gl.load(at), gl.load(at + 16 * NW), gl.load(at + 32 * NW), gl.load(at + 48 * NW),
                 gl.load(at + 64 * NW), gl.load(at + 80 * NW), gl.load(at + 96 * NW), gl.load(at + 112 * NW))
    else:  # the first AHEAD steps' words; a step's place holds zeros (never read) until its words are requested
        none = gl.zeros([16, 16], gl.int32, LA)
        steps = (none, none, none, none, none, none, none, none)
        for s in gl.static_range(AHEAD):
            steps = _put(steps, s, gl.load(at + s * 16 * NW))

    limbs = gl.allocate_shared_memory(gl.bfloat16, [K, 8], _SMEM, _limb_tile(k_at, q_at, K).to(gl.bfloat16))
    zero = gl.zeros([16, 8], gl.float32, MMA)
    f0, f1, f2, f3, f4, f5, f6, f7 = zero, zero, zero, zero, zero, zero, zero, zero
    for g in gl.static_range(K // G):
        o0, o1, o2, o3, o4, o5, o6, o7 = _offsets(zero_at, g, SYM, NW)
        a0, a1, a2, a3, a4, a5, a6, a7 = zero, zero, zero, zero, zero, zero, zero, zero
        for j in gl.static_range(PER_GROUP):
            if AHEAD < STEPS and g * PER_GROUP + j + AHEAD < STEPS:
                steps = _put(steps, g * PER_GROUP + j + AHEAD, gl.load(at + (g * PER_GROUP + j + AHEAD) * 16 * NW))
            w = steps[g * PER_GROUP + j]
            bk = limbs.slice(g * G + j * 16, 16, dim=0).load(LB)
            p0, p1, p2, p3, p4, p5, p6, p7 = _planes(w)
            a0 = mma_v2(p0 - o0, bk, a0)
            a1 = mma_v2(p1 - o1, bk, a1)
            a2 = mma_v2(p2 - o2, bk, a2)
            a3 = mma_v2(p3 - o3, bk, a3)
            a4 = mma_v2(p4 - o4, bk, a4)
            a5 = mma_v2(p5 - o5, bk, a5)
            a6 = mma_v2(p6 - o6, bk, a6)
            a7 = mma_v2(p7 - o7, bk, a7)
        s_at = scale_at + g * V
        f0 = _scaled(a0, f0, s_at, 0)
        f1 = _scaled(a1, f1, s_at, 1)
        f2 = _scaled(a2, f2, s_at, 2)
        f3 = _scaled(a3, f3, s_at, 3)
        f4 = _scaled(a4, f4, s_at, 4)
        f5 = _scaled(a5, f5, s_at, 5)
        f6 = _scaled(a6, f6, s_at, 6)
        f7 = _scaled(a7, f7, s_at, 7)
    return f0, f1, f2, f3, f4, f5, f6, f7


_BYTE_PLANES = gl.constexpr("{\n.reg .b32 t, s;\nprmt.b32 t, $2, $3, 0x4400;\n"
                             "lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xEA;\nshr.b32 s, t, 4;\n"
                             "lop3.b32 $1, s, 0x000F000F, 0x43004300, 0xEA;\n}")
""":data:`_PLANES` for byte 0 only: two words (the same 8 columns of key rows r and r + 1) -> the bfloat16 pairs
``(128 + c[r], 128 + c[r+1])`` of code places 0 and 1."""


@gluon.jit
def _byte_planes(w):
    """Code places 0 and 1 (byte 0) of the words ``w`` (int32, A-operand layout, pairs of consecutive key rows in one
    thread) as bfloat16 ``128 + c``."""
    return gl.inline_asm_elementwise(_BYTE_PLANES, "=r,=r,r,r", [w], (gl.bfloat16, gl.bfloat16), True, 2)


@gluon.jit
def _split_scaled(acc, final, s_at, p: gl.constexpr, P: gl.constexpr, MW: gl.constexpr):
    """``final + s acc`` for :func:`head_dots_split`'s accumulator of place ``p``: row ``16 w + i`` is value column
    ``8 i + w P + p``, whose fp16 scale ``s`` is at ``s_at``."""
    rho = gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, MW))
    s = gl.load(s_at + 8 * (rho % 16) + (rho // 16) * P + p).to(gl.float32)
    return final + s[:, None] * acc


@gluon.jit
def head_dots_split(k_at, q_at, codes_at, scale_at, K: gl.constexpr, V: gl.constexpr, G: gl.constexpr,
                    W: gl.constexpr):
    """:func:`head_dots` of symmetric 4-bit codes by ``W`` warps (2 or 4), split over the value columns: warp ``w``
    takes the code places ``m = w P .. w P + P - 1`` (``P = 8 / W``) of every word, so it loads every word of the head
    (the other warps' loads of them hit the cache) and unpacks, multiplies and scales ``1 / W`` of them. Returns four
    accumulators ``[16 W, 8]`` (an ``mma.m16n8k16`` layout over ``W`` warps): row ``16 w + i`` of the ``p``-th is
    value column ``8 i + w P + p``, its columns as :func:`head_dots`' (the last two zero where ``P = 2``). Every
    product is exact and the sums are :func:`head_dots`' in the same order per column."""
    MW: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1], instr_shape=[16, 8])
    AW: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MW, k_width=2)
    BW: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MW, k_width=2)
    P: gl.constexpr = 8 // W
    NW: gl.constexpr = V // 8
    PER_GROUP: gl.constexpr = G // 16
    gl.static_assert(W == 2 or W == 4, "2 or 4 warps per head: 4 or 2 code places each")
    gl.static_assert(NW == 16 and K == 128 and G % 16 == 0, "as head_dots: K = V = 128, key groups of 16-row steps")
    rho = gl.arange(0, 16 * W, layout=gl.SliceLayout(1, AW))[:, None]
    r = gl.arange(0, 16, layout=gl.SliceLayout(0, AW))[None, :]
    at = codes_at.to(gl.pointer_type(gl.int32)) + r * NW + rho % 16  # every warp the step's [16 words, 16 rows]
    shift = (rho // 16) * (4 * P) + gl.zeros([16 * W, 16], gl.int32, AW)  # byte w P / 2 of each word to byte 0
    steps = (gl.load(at), gl.load(at + 16 * NW), gl.load(at + 32 * NW), gl.load(at + 48 * NW),
             gl.load(at + 64 * NW), gl.load(at + 80 * NW), gl.load(at + 96 * NW), gl.load(at + 112 * NW))

    limbs = gl.allocate_shared_memory(gl.bfloat16, [K, 8], _SMEM, _limb_tile(k_at, q_at, K, W).to(gl.bfloat16))
    zero = gl.zeros([16 * W, 8], gl.float32, MW)
    off = gl.full([16 * W, 16], 136.0, gl.bfloat16, AW)  # 128 + 8: symmetric codes
    f0, f1, f2, f3 = zero, zero, zero, zero
    for g in gl.static_range(K // G):
        a0, a1, a2, a3 = zero, zero, zero, zero
        for j in gl.static_range(PER_GROUP):
            w = steps[g * PER_GROUP + j]
            bk = limbs.slice(g * G + j * 16, 16, dim=0).load(BW)
            lo, hi = _byte_planes(w >> shift)
            a0 = mma_v2(lo - off, bk, a0)
            a1 = mma_v2(hi - off, bk, a1)
            if P == 4:
                lo, hi = _byte_planes(w >> (shift + 8))
                a2 = mma_v2(lo - off, bk, a2)
                a3 = mma_v2(hi - off, bk, a3)
        s_at = scale_at + g * V
        f0 = _split_scaled(a0, f0, s_at, 0, P, MW)
        f1 = _split_scaled(a1, f1, s_at, 1, P, MW)
        if P == 4:
            f2 = _split_scaled(a2, f2, s_at, 2, P, MW)
            f3 = _split_scaled(a3, f3, s_at, 3, P, MW)
    return f0, f1, f2, f3


@gluon.jit
def _dots_kernel(q_ptr, k_ptr, y_ptr, map_ptr, codes_ptr, scale_ptr, zero_ptr,
                 H: gl.constexpr, HV: gl.constexpr, HP: gl.constexpr, MAPPED: gl.constexpr, K: gl.constexpr,
                 V: gl.constexpr, G: gl.constexpr, SYM: gl.constexpr, SS: gl.constexpr, ZS: gl.constexpr,
                 AHEAD: gl.constexpr = 8):
    """``y [B*HV, 2, V]`` = ``Ŝᵀk_t, Ŝᵀq_t`` of one (sequence, value head) per program (one warp,
    :func:`head_dots`); the checkpoint part holds ``HP`` value heads per sequence (``MAPPED``: its slot ``s`` is value
    head ``map_ptr[s]``), ``SS`` fp16 scales and ``ZS`` zero-point bytes per head."""
    pid = gl.program_id(0).to(gl.int64)
    b, slot, h, kh = part_head(pid, map_ptr, H, HV, HP, MAPPED)
    head = b * HP + slot
    f0, f1, f2, f3, f4, f5, f6, f7 = head_dots(k_ptr + (b * H + kh) * K, q_ptr + (b * H + kh) * K,
                                               codes_ptr + head * (K * V // 2), scale_ptr + head * SS,
                                               zero_ptr + head * ZS, K, V, G, SYM, AHEAD)
    y_at = y_ptr + (b * HV + h) * 2 * V
    _store(f0, y_at, 0, V)
    _store(f1, y_at, 1, V)
    _store(f2, y_at, 2, V)
    _store(f3, y_at, 3, V)
    _store(f4, y_at, 4, V)
    _store(f5, y_at, 5, V)
    _store(f6, y_at, 6, V)
    _store(f7, y_at, 7, V)


def launch(plan: DecodePlan, q: torch.Tensor, k: torch.Tensor, launch: SplitLaunch) -> None:
    """One :func:`_dots_kernel` launch over the value heads of one 4-bit part (``launch``, one of
    ``plan.split.dots``; ``q, k [B, H, K]`` float32) into ``plan.workspace``."""
    B, H, HV, K, V = plan.shape
    sp = plan.split
    part = launch.ckpt.parts[0]
    cap = {} if sp.settings.dots_maxnreg is None else {"maxnreg": sp.settings.dots_maxnreg}
    ahead = {} if sp.settings.dots_ahead == 8 else {"AHEAD": sp.settings.dots_ahead}
    _dots_kernel[(B * launch.heads,)](q, k, plan.workspace, launch.ckpt.table, part.codes, part.scale, part.zero, H=H,
                                      HV=HV, HP=launch.heads, MAPPED=launch.ckpt.mapped, K=K, V=V, G=sp.group,
                                      SYM=sp.symmetric, SS=part.layout.scale_size, ZS=part.layout.zero_size,
                                      num_warps=1, **ahead, **cap)
