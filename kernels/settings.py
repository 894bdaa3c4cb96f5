"""Launch settings of the decode kernels: one frozen dataclass per kernel family, validated when it is made.

- :class:`SplitSettings`: packed key-axis checkpoints (PACE-4, PACE-4/8): the step (:mod:`kernels.packed_step`,
  :mod:`kernels.gluon_step`, :mod:`kernels.gluon_dots`) and the flush (:mod:`kernels.flush`,
  :mod:`kernels.gluon_flush`);
- :class:`FusedSettings`: the one-kernel step of dense and value-axis checkpoints (:mod:`kernels.fused_step`);
- :class:`RecurrentSettings`: dP = 1 and the per-token baselines (:mod:`kernels.recurrent_step`);
- :class:`Launch`: the three, what a :class:`kernels.backend.TritonSteps` runs with.

The defaults are the fastest settings measured (kernels/bench/NOTES.md); kernels/bench/bench.py tries others side by
side.
Settings change which code runs and how it is laid out on the GPU, never what it computes beyond float32 rounding
(the GPU tests hold every alternative to the Triton kernels).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Literal

from pace_core.errors import PaceError

AUTO = "auto"
Auto = Literal["auto"]

WARPS = (1, 2, 4, 8, 16)
"""Warps per program Triton and Gluon launch (powers of two)."""
MAXNREG = range(32, 256)
"""Register caps ptxas takes (``.maxnreg``): a cap below what the compiler would use trades registers for occupancy,
and spills past it (kernels/bench/sass.py reports the stack)."""


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _pow2(x: object) -> bool:
    return _int(x) and x >= 1 and x & (x - 1) == 0


RULES = {
    "warps": (lambda x: _int(x) and x in WARPS, f"one of {WARPS}"),
    "warps|none": (lambda x: x is None or (_int(x) and x in WARPS), f"None or one of {WARPS}"),
    "pow2": (_pow2, "a power of two"),
    "pow2|none": (lambda x: x is None or _pow2(x), "None or a power of two"),
    "auto": (lambda x: isinstance(x, bool) or x == AUTO, 'True, False or "auto"'),
    "bool": (lambda x: isinstance(x, bool), "True or False"),
    "maxnreg": (lambda x: x is None or (_int(x) and x in MAXNREG), f"None or {MAXNREG.start}..{MAXNREG.stop - 1}"),
    "step_split": (lambda x: _int(x) and x in (1, 2, 4), "1, 2 or 4"),
    "ahead": (lambda x: _int(x) and x in (2, 4, 8), "2, 4 or 8"),
}
"""The checks of a setting's value: rule name -> (predicate, what is allowed)."""


def _check(owner: object, **rules: str) -> None:
    """Each field named in ``rules`` checked against its rule (:data:`RULES`): a PaceError naming the setting, its
    value and what is allowed."""
    for name, rule in rules.items():
        ok, allowed = RULES[rule]
        if not ok(getattr(owner, name)):
            raise PaceError(f"launch setting {type(owner).__name__}.{name}={getattr(owner, name)!r} not allowed; "
                            f"allowed: {allowed}")


@dataclass(frozen=True)
class SplitSettings:
    """The split path's launches (a packed key-axis checkpoint: PACE-4, PACE-4/8).

    The step: one kernel (``fused_step``: :mod:`kernels.gluon_step` where ``gluon_step`` and the format allow, with
    ``gluon_step_warps`` warps per (sequence, value head): 1, or 2 or 4 splitting the head's value columns, for
    batches that leave SMs idle; else the Triton ``_ckpt_step_kernel`` with ``step_warps``) or two (the dots kernel,
    ``dots_columns`` per program and ``dots_warps``, :mod:`kernels.gluon_dots` for 4-bit parts where ``gluon_dots``;
    the record kernel with ``record_warps``). ``"auto"`` fuses where the Gluon step applies, otherwise when the
    (sequence, value head) programs are at most one wave (the SMs): there the launch saved outweighs the Triton step's
    block-wide reductions (faster at batch 1-4 on the H200, slower from 8).

    The flush: the Triton kernel (``flush_warps``, ``flush_columns`` per program; 4-bit codes as two half tiles of
    ``flush_columns / 2``, at least 16 on the GPU for tensor-core tiles) or :mod:`kernels.gluon_flush` for 4-bit
    parts (``gluon_flush``), ``flush_row_blocks`` programs per 32 columns of a head, each over ``K / row_blocks`` key
    rows (whole key groups; more programs at small batch).

    Two bit widths (PACE-4/8): the dots (``dots_per_part``), the flush and the window (``per_part``) launched once
    per width; ``"auto"``: when the programs are more than the SMs (in one wave one launch is faster), always under
    the interpreter (so that the tests run it).

    ``step_folds``: a state pool's Gluon step (one warp per head) also folds the slots its token fills and forgets
    their records, in the same programs (:mod:`kernels.gluon_step`, with :mod:`kernels.gluon_flush`'s fold): no
    full-slot list, flush or forget launch. Where the Gluon flush applies too; the whole-batch step ignores it.

    ``dots_ahead``: the 16-row steps of a head's codes the Gluon dots and step request ahead (8: all, 64 registers
    of words per thread; fewer leave registers for more warps per SM).

    ``*_maxnreg``: a register cap (ptxas ``.maxnreg``) for the step kernels (one-kernel and window), the dots kernels
    and the flush kernels; None leaves the compiler's choice. Caps below the compiler's count spill (local memory;
    kernels/bench/NOTES.md, issue 43).
    """

    fused_step: bool | Auto = AUTO
    step_warps: int = 4
    dots_columns: int = 128
    dots_warps: int = 4
    record_warps: int = 1
    flush_warps: int = 4
    flush_columns: int = 128
    dots_per_part: bool | Auto = AUTO
    per_part: bool | Auto = AUTO
    gluon_dots: bool = True
    gluon_flush: bool = True
    gluon_step: bool = True
    gluon_step_warps: int = 1
    step_folds: bool = False
    dots_ahead: int = 8
    step_maxnreg: int | None = None
    dots_maxnreg: int | None = None
    flush_maxnreg: int | None = None
    flush_row_blocks: int = 1

    def __post_init__(self) -> None:
        _check(self, fused_step="auto", step_warps="warps", dots_columns="pow2", dots_warps="warps",
               record_warps="warps", flush_warps="warps", flush_columns="pow2", dots_per_part="auto",
               per_part="auto", gluon_dots="bool", gluon_flush="bool", gluon_step="bool", step_maxnreg="maxnreg",
               gluon_step_warps="step_split", step_folds="bool", dots_ahead="ahead",
               dots_maxnreg="maxnreg", flush_maxnreg="maxnreg", flush_row_blocks="pow2")

    def resolved(self, one_wave: bool, gluon_step: bool) -> SplitSettings:
        """These settings with every ``"auto"`` decided (class docstring): ``one_wave``, whether the (sequence,
        value head) programs fit in one wave of the GPU's SMs; ``gluon_step``, whether the Gluon step applies."""
        pick = lambda x, auto: auto if x == AUTO else x  # noqa: E731
        return replace(self, fused_step=pick(self.fused_step, gluon_step or one_wave),
                       dots_per_part=pick(self.dots_per_part, not one_wave), per_part=pick(self.per_part, not one_wave))


@dataclass(frozen=True)
class FusedSettings:
    """The one-kernel step of dense and value-axis checkpoints (:func:`kernels.fused_step.launch_fused`): ``rows``
    key rows per tile (at most K; None: 32, or a key group where key-axis groups are wider) and ``num_warps`` (None:
    8 for tiles of 8192 values or more, else 4)."""

    rows: int | None = None
    num_warps: int | None = None

    def __post_init__(self) -> None:
        _check(self, rows="pow2|none", num_warps="warps|none")


@dataclass(frozen=True)
class RecurrentSettings:
    """The per-token recurrence (:func:`kernels.recurrent_step.recurrent_run`): ``block_v`` value columns per program
    (None: :func:`kernels.recurrent_step._columns`'s rule) and ``num_warps``."""

    block_v: int | None = None
    num_warps: int = 4

    def __post_init__(self) -> None:
        _check(self, block_v="pow2|none", num_warps="warps")


Settings = SplitSettings | FusedSettings | RecurrentSettings


@dataclass(frozen=True)
class Launch:
    """The launch settings of a :class:`kernels.backend.TritonSteps`, one per kernel family."""

    split: SplitSettings = field(default_factory=SplitSettings)
    fused: FusedSettings = field(default_factory=FusedSettings)
    recurrent: RecurrentSettings = field(default_factory=RecurrentSettings)

    @classmethod
    def of(cls, settings: Settings | None) -> Launch:
        """The defaults with one family's ``settings`` (None: the defaults)."""
        if settings is None:
            return cls()
        for f in fields(cls):
            if isinstance(settings, type(getattr(cls(), f.name))):
                return cls(**{f.name: settings})
        raise PaceError(f"launch settings: {type(settings).__name__} not allowed; allowed: SplitSettings, "
                        "FusedSettings, RecurrentSettings")
