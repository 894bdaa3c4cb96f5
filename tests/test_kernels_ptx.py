"""The inline PTX of the Gluon kernels on every byte value, run by a small emulator of the instructions they use
(``and``, ``or``, ``shl``, ``shr``, ``prmt``, ``lop3`` on 32-bit registers, after the PTX ISA's definitions), so
that the CPU tests check what the strings compute; the GPU tests check the kernels built from them."""

from __future__ import annotations

import re

import numpy as np
import pytest

from kernels import gluon_dots, gluon_flush

MASK = 0xFFFFFFFF


def _prmt(a: int, b: int, c: int) -> int:
    """``prmt.b32`` (default mode): byte ``i`` of the result is byte ``c[4i:4i+3] & 7`` of ``{b, a}``, or that
    byte's sign replicated where selector bit 3 is set."""
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = src[sel & 7]
        out |= ((0xFF if byte & 0x80 else 0) if sel & 8 else byte) << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """``lop3.b32``: each result bit is bit ``4 a + 2 b + c`` of ``lut`` (a = 0xF0, b = 0xCC, c = 0xAA)."""
    out = 0
    for bit in range(32):
        index = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((lut >> index) & 1) << bit
    return out


OPS = {"and.b32": lambda a, b: a & b, "or.b32": lambda a, b: a | b, "shl.b32": lambda a, b: (a << b) & MASK,
       "shr.b32": lambda a, b: a >> b, "prmt.b32": _prmt, "lop3.b32": _lop3}


def run_ptx(asm: str, args: list[int], outputs: int) -> list[int]:
    """Run the PTX block ``asm`` with operands ``$0 ..`` (the ``outputs`` results, then ``args``, as 32-bit
    registers) and return the results."""
    regs = {f"${outputs + i}": a & MASK for i, a in enumerate(args)}
    for line in asm.strip().strip("{}").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *srcs = [x.strip() for x in rest.split(",")]
        values = [int(s, 0) if re.fullmatch(r"0x[0-9A-Fa-f]+|\d+", s) else regs[s] for s in srcs]
        regs[dst] = OPS[op](*values) & MASK
    return [regs[f"${i}"] for i in range(outputs)]


def _float(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint32).view(np.float32)[0])


def _bf16_pair(bits: int) -> tuple[float, float]:
    return tuple(float(np.array([((bits >> s) & 0xFFFF) << 16], dtype=np.uint32).view(np.float32)[0])
                 for s in (0, 16))


def _words(rng: np.random.Generator, n: int = 64) -> list[int]:
    """Words whose 4 bytes together take every value 0-255 at every place (a random permutation per place)."""
    places = [rng.permutation(256) for _ in range(4)]
    words = [int(sum(int(places[p][i]) << (8 * p) for p in range(4))) for i in range(256)]
    return words + [int(w) for w in rng.integers(0, 2**32, n, dtype=np.uint64)]


def test_flush_unpack_gives_each_code_under_two_to_the_23() -> None:
    rng = np.random.default_rng()
    for w in _words(rng):
        out = run_ptx(gluon_flush._UNPACK.value, [w], 8)
        assert [_float(x) for x in out] == [2.0**23 + ((w >> (4 * p)) & 15) for p in range(8)]


def test_flush_pack_is_the_inverse_of_unpack() -> None:
    """The low byte of each input is its code (the magic sums' bits ``0x4B40000c`` included)."""
    rng = np.random.default_rng()
    for w in _words(rng):
        codes = [(w >> (4 * p)) & 15 for p in range(8)]
        for base in (0, 0x4B400000):
            assert run_ptx(gluon_flush._PACK.value, [base + c for c in codes], 1) == [w]


def test_flush_columns_are_the_thread_words() -> None:
    """Accumulator column ``8t + 2q + e`` of column tile ``c`` is value column ``32c + 8q + 2t + e``: the thread with
    lane ``q`` of its quad holds code ``2t + e`` of word ``q`` (bytes ``4q .. 4q + 3`` of the tile's 16)."""
    for ct in range(4):
        seen = set()
        for t in range(4):
            for q in range(4):
                for e in range(2):
                    n = 8 * t + 2 * q + e
                    v = (ct * 32 + 8 * ((n >> 1) & 3) + 2 * (n >> 3) + (n & 1))
                    assert v // 2 == ct * 16 + 4 * q + t and v % 2 == e  # byte t of word q, nibble e
                    seen.add(v)
        assert seen == set(range(32 * ct, 32 * ct + 32))


def test_dots_planes_give_each_code_of_two_rows_as_bfloat16() -> None:
    """gluon_dots: two words (the same 8 columns of key rows r and r + 1) -> 8 bfloat16 pairs ``128 + c``, code place
    ``m``: row r in the low half, row r + 1 in the high half."""
    rng = np.random.default_rng()
    words = _words(rng)
    for w0, w1 in zip(words, words[::-1]):
        out = run_ptx(gluon_dots._PLANES.value, [w0, w1], 8)
        for m, bits in enumerate(out):
            assert _bf16_pair(bits) == (128.0 + ((w0 >> (4 * m)) & 15), 128.0 + ((w1 >> (4 * m)) & 15))


def test_dots_byte_planes_are_the_planes_of_byte_0() -> None:
    """gluon_dots._BYTE_PLANES (the step split over warps: each warp its bytes, shifted to byte 0): code places 0 and 1
    of two words as the bfloat16 pairs ``128 + c``, the same as places 0 and 1 of :data:`gluon_dots._PLANES`, and of
    byte ``b`` after the words are shifted right by ``8 b`` (arithmetic: the sign bits land above byte 0)."""
    rng = np.random.default_rng()
    words = _words(rng)
    for w0, w1 in zip(words, words[::-1]):
        planes = run_ptx(gluon_dots._PLANES.value, [w0, w1], 8)
        for b in range(4):
            shifted = [(int(np.array([w], dtype=np.uint32).view(np.int32)[0]) >> (8 * b)) & MASK for w in (w0, w1)]
            assert run_ptx(gluon_dots._BYTE_PLANES.value, shifted, 2) == planes[2 * b:2 * b + 2]


@pytest.mark.parametrize("asm,args,expected", [
    ("prmt.b32 $0, $1, $2, 0x3210;", [0x44332211, 0x88776655], 0x44332211),
    ("prmt.b32 $0, $1, $2, 0x7654;", [0x44332211, 0x88776655], 0x88776655),
    ("prmt.b32 $0, $1, $2, 0x0008;", [0x000000F0, 0], 0xF0F0F0FF),  # byte 0's sign replicated, then byte 0
    ("lop3.b32 $0, $1, $2, $3, 0xEA;", [0xF0F0F0F0, 0xFF00FF00, 0x0000000F], 0xF000F00F),  # (a & b) | c
])
def test_the_emulator_follows_the_isa(asm: str, args: list[int], expected: int) -> None:
    assert run_ptx("{" + asm + "}", args, 1) == [expected]
