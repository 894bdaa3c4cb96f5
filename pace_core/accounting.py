"""Resident bits per state value (PACE_SPEC §5), state bytes, and what fits in memory.

**The paper's accounting** (per state value, averaged over the GDN layers of one sequence):
``resident = payload + metadata + c · dP`` with

- ``payload``: the stored state with its scales and zero points, the seeds' "payload" (5.65625 for
  PACE-4/8, "5.66, the same as DAMP INT4"). It is reported in two parts:
  ``code_bits``: rtn / pace ``(1 − s)·b + s·b_high``, ``s`` = share of heads at ``high_bits`` (the
  real per-layer head counts, ``round(high_share · HV)`` or ``high_heads``); damp
  ``((d_k − r)·b + r·16) / d_k`` (r outlier key rows kept in fp16); dsq ``b``; references 32 or 16.
  ``scale_bits``: groups of g: ``16/g`` per value (fp16 scale) plus, with a zero point, ``b/g``
  (zero points stored in b bits; high heads ``b_high/g``); damp ``16/g`` on the ``d_k − r``
  quantised rows; dsq ``16 (d_k + d_v) / (d_k d_v)`` (row scales r_k and column scales c_v, fp16);
  references 0. PACE-4/8: ``0.75·(4 + 16/32 + 4/32) + 0.25·(8 + 16/32 + 8/32) = 5.65625``.
- ``c · dP``: the decode buffer, ``c = (b_k d_k / γ + b_v d_v + 32) / (d_k d_v)`` **[seed]**; keys are
  shared by the γ value heads of a key head, 32 = the fp32 log decay. ``(b_k, b_v)`` are the bits stored
  per buffered entry (:func:`pace_core.buffer.entry_bits`): fp32 (32, 32), bf16 (16, 16); an integer part
  (int8 keys and values, mixed: 4-bit keys, bf16 values) adds its share of each group's fp16 scale and
  zero point **[ours]**: int8 per vector ``8 + 16/128``, PACE-4/8's 4-bit keys in groups of 16 with zero
  points ``4 + 16/16 + 4/16 = 5.25``. So ``c`` follows the buffer settings; the paper's ``c`` counts the
  codes alone (:func:`paper_c`). There is no buffer at dP = 1 (per-token rounding): the term is 0 there
  (``c`` is still reported).
- ``metadata`` **[ours]**: what the implementation stores beyond payload and ``c · dP``: DAMP's outlier-row
  indices and PACE-4/8's head map (int16 per value head, once per layer), and the padding of a row of codes or
  zero points to a whole byte (every width is packed densely: 0 where rows of b-bit codes fill whole bytes, e.g.
  3-bit zero points of 4 value-axis groups a row take 2 bytes for 12 bits). So ``resident`` equals the exact
  stored bits (``exact_bits``).

**Exact bits** (``exact_bits``, :func:`state_bytes`): the bytes the implementation stores, from the
storage code itself: :func:`pace_core.quant.packed_nbytes` (b-bit codes packed densely, ``ceil(n b / 8)``
bytes a row of n; fp16 scales; zero points packed the same way along their rows), separate packed parts for the
low- and high-bit heads (the head map is part
of the configuration, not of a sequence), :meth:`pace_core.methods.damp.DampQuantizer.nbytes` (fp16
outlier rows, INT-b rest with fp16 scales, and the int16 outlier-row indices ``[HV, r]`` once per
layer), DSQ's packed codes with fp16 row scales ``[K]`` and column scales ``[V]`` per head, and
:func:`pace_core.buffer.record_bytes` times dP records (int8 / mixed buffers add one fp16 scale per
key vector and, for int8, per value vector). ``exact_bits`` is ``8 · state_bytes(cfg, shape, 1)``
divided by the state values of one sequence.

**Outside the state, by design** (:func:`host_bytes`): stochastic rounding's generator (``pace-4-sr``). Each
GDN layer's format holds one ``torch.Generator`` (:attr:`pace_core.checkpoint.StateFormat.generator`), a host object
whose state is 5,056 bytes on the CPU (torch's Mersenne Twister: 121,344 B = 121 KB at Qwen3.5-4B's 24 GDN layers)
and 16 bytes on the host for a CUDA generator (Philox seed and offset). It is the rounding's source of randomness,
not a sequence's state: it is kept once per layer whatever the number of sequences, never in the device memory
that :func:`capacity` budgets, never in a serving pool (a vLLM pool refuses stochastic rounding), and it is no
tensor, so :func:`state_bytes` and the bytes held (:func:`pace_core.memory.held_bytes`) both leave it out.
:func:`host_bytes` reports it.

Readings of the seeds' numbers (reported, and checked in tests/test_accounting.py):

- PACE-4 "5.03 bits on Qwen3.5-27B": the paper's formula (:func:`paper_c`) gives 4.93229 on 27B (γ = 3)
  and 5.01563 on the γ = 2 backbones; the stored bits (one fp16 scale per buffered int8 vector) are
  4.94271 on 27B and **5.02734 -> 5.03** on 4B / 9B / 35B-A3B. **[ours]**: 5.03 is reproduced by the
  stored bits at γ = 2.
- PACE-4/8 "6.82 on Qwen3.5-27B": the paper's formula gives 6.75521 (27B), 6.79688 (γ = 2). With the
  buffer keys this project measured best (4-bit groups of 16 with zero points, pace_core.config) the
  stored bits are **6.78223** on 27B and 6.83691 at γ = 2: the paper's figure lies between them (0.6%
  above 27B's). Per-vector 4-bit keys would give 6.75781 (27B); 6.82 itself would need, at γ = 2,
  groups of 32 with zero points (6.8164), which measured worse (pace_core.config).
- DAMP INT8 "9.90 on Qwen3.5-27B": our §6 reading (16 fp16 rows of 128, INT8 value-axis groups of
  32) gives 9.4375 (exact 9.453125), and DAMP INT4 5.9375 instead of the seeds' 5.66. Not
  reproduced; no clean reading of fp16 rows, group scales, zero points and a buffer yields 9.90
  together with a DAMP INT4 payload of 5.66.
- "An fp32 state takes 10–41% of weights + state at 64 sequences": with bf16 weights (the text
  model transformers loads) the paper's four backbones give 27.7% (4B), 15.2% (9B), 15.2% (27B),
  5.5% (35B-A3B); with weights at 1 byte per parameter 43.4%, 26.5%, 26.4%, 10.4%. **[ours]**: the
  closest reading is 1 byte per weight parameter (FP8 weights, ``state_share(...,
  weight_bytes_per_param=1)``): the lower end (10%) matches, the upper end is 43% instead of 41%
  (counting the 4B checkpoint's vision tower and MTP head, which transformers does not load,
  would lower it). Qwen3-Next-80B-A3B (not a paper backbone) is at 2.9% / 5.7%.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch

from pace_core.buffer import BUFFER_LAYOUT, entry_bits, record_bytes
from pace_core.config import PaceConfig
from pace_core.errors import PaceError
from pace_core.frontier import KL, Axis, Point, best_under
from pace_core.methods import method_of
from pace_core.shapes import ModelShape

LOG_DECAY_BITS = 32


@dataclass(frozen=True)
class ResidentBits:
    """Bits per state value of one configuration on one model (see the module docstring).

    payload_bits + metadata_bits + buffer_bits = resident_bits = exact_bits (the bits actually
    stored); payload_bits = code_bits + scale_bits; ``c`` is the buffer cost per state value per
    buffered token (with the stored scale shares); formula_bits = payload_bits + paper_c · dP is the
    paper's formula alone (:func:`paper_c`); sequence_bits: the bits each further sequence adds
    (:func:`state_bytes_per_sequence`: what is kept once per layer left out, e.g. static scales' ranges).
    """

    code_bits: float
    scale_bits: float
    payload_bits: float
    metadata_bits: float
    buffer_bits: float
    resident_bits: float
    c: float
    exact_bits: float
    paper_c: float
    formula_bits: float
    sequence_bits: float


def _check(cfg: PaceConfig, shape: ModelShape) -> None:
    if not isinstance(cfg, PaceConfig):
        raise PaceError(f"cfg must be a PaceConfig; got {type(cfg).__name__}")
    if not isinstance(shape, ModelShape):
        raise PaceError(f"shape must be a ModelShape; got {type(shape).__name__}")
    cfg.validate_for(shape)


def _c(b_k: Fraction, b_v: Fraction, shape: ModelShape) -> Fraction:
    """``c = (b_k d_k / γ + b_v d_v + 32) / (d_k d_v)`` (spec §5)."""
    return (b_k * shape.d_k / shape.gamma + b_v * shape.d_v + LOG_DECAY_BITS) / (shape.d_k * shape.d_v)


def buffer_c(cfg: PaceConfig, shape: ModelShape) -> Fraction:
    """``c`` with the config's buffer entries' stored bits, their group scales and zero points included
    (:func:`pace_core.buffer.entry_bits`; exact)."""
    return _c(*entry_bits(cfg.buffer_format, shape.d_k, shape.d_v), shape)


def paper_c(cfg: PaceConfig, shape: ModelShape) -> Fraction:
    """The paper's ``c``: the buffer's code bits alone, ``(b_k, b_v)`` = fp32 (32, 32), bf16 (16, 16),
    int8 (8, 8), mixed (4, 16), no scales (for the readings of the seeds' figures)."""
    bits = [Fraction(k if isinstance(k, int) else torch.finfo(k).bits) for k in BUFFER_LAYOUT[cfg.buffer]]
    return _c(*bits, shape)


def _formula_terms(cfg: PaceConfig, shape: ModelShape) -> tuple[Fraction, Fraction]:
    """(code bits, scale bits) per state value, exact fractions (the method's payload)."""
    return method_of(cfg).payload(cfg, shape)


def _check_n(n_seq: int, field: str = "n_seq") -> None:
    if isinstance(n_seq, bool) or not isinstance(n_seq, int) or n_seq < 0:
        raise PaceError(f"{field}={n_seq!r} is not allowed; allowed: an integer >= 0")


def state_bytes(cfg: PaceConfig, shape: ModelShape, n_seq: int) -> int:
    """Bytes the implementation keeps resident for `n_seq` sequences: every GDN layer's stored state
    plus, when buffered (dP > 1), its decode buffer of dP records; the once-per-layer DAMP row indices
    and PACE-4/8 head maps are included (0 sequences -> 0 bytes)."""
    _check(cfg, shape)
    _check_n(n_seq)
    if n_seq == 0:
        return 0
    method = method_of(cfg)
    total = sum(method.layer_bytes(cfg, shape, n_seq, layer) + method.fixed_bytes(cfg, shape, layer)
                for layer in range(shape.num_gdn_layers))
    if cfg.buffered:
        record = record_bytes(cfg.buffer_format, shape.num_k_heads, shape.num_v_heads, shape.d_k, shape.d_v)
        total += shape.num_gdn_layers * n_seq * cfg.decode_period * record
    return total


def host_bytes(cfg: PaceConfig, shape: ModelShape, device: torch.device | str = "cpu") -> int:
    """Bytes ``cfg`` keeps on the host beside its state on ``device``, outside :func:`state_bytes` by design
    (module docstring): stochastic rounding's generators, one per GDN layer (the size of a ``torch.Generator``'s
    state on ``device``: 5,056 on the CPU, 16 for CUDA); 0 for every other configuration."""
    _check(cfg, shape)
    if cfg.rounding != "stochastic":
        return 0
    return shape.num_gdn_layers * torch.Generator(device).get_state().numel()


def state_bytes_per_sequence(cfg: PaceConfig, shape: ModelShape) -> int:
    """The bytes each further sequence adds (:func:`state_bytes` without what is kept once per layer)."""
    return state_bytes(cfg, shape, 2) - state_bytes(cfg, shape, 1)


DECODE_WORKSPACE_STATES = 10
"""Bound of one decode call's workspace in float32 copies of the layer's state for the batch (the reference
backend; measured 2.0 for fp32 up to 8.9 for DAMP by :class:`pace_core.memory.PeakBytes`,
tests/test_state_store.py)."""
PREFILL_WORKSPACE_STATES = 10
PREFILL_WORKSPACE_ACTIVATIONS = 8
"""Bound of one prefill call's workspace: this many float32 layer states, plus this many times one P-token
segment's ``k`` and ``v`` rows padded to whole chunks of 64, plus the call's outputs twice (gathered, then
joined); the chunked GDN's intermediates (measured up to 7x the segment's rows and 5 states)."""


def transient_bytes(cfg: PaceConfig, shape: ModelShape, n_seq: int, tokens: int = 1, *, prefill: bool = False) -> int:
    """**Peak transient**: the most bytes one call of one GDN layer allocates beyond the resident state
    (:func:`state_bytes`) for ``n_seq`` sequences and ``tokens`` tokens, freed when the call returns (the
    dequantised checkpoint, the folded state of a flush, the chunked GDN's intermediates). Never resident:
    between calls a layer holds exactly :func:`state_bytes`' share. A decode call (``prefill`` False) is bounded
    by :data:`DECODE_WORKSPACE_STATES` float32 states; a prefill by :data:`PREFILL_WORKSPACE_STATES` states plus
    :data:`PREFILL_WORKSPACE_ACTIVATIONS` times one segment's padded rows plus twice its outputs."""
    _check(cfg, shape)
    _check_n(n_seq)
    _check_n(tokens, "tokens")
    hv, k, v = shape.num_v_heads, shape.d_k, shape.d_v
    layer = 4 * n_seq * hv * k * v
    if not prefill:
        return DECODE_WORKSPACE_STATES * layer
    rows = -(-min(tokens, cfg.prefill_period) // 64) * 64
    return (PREFILL_WORKSPACE_STATES * layer + PREFILL_WORKSPACE_ACTIVATIONS * 4 * n_seq * rows * hv * (k + v)
            + 2 * 4 * n_seq * tokens * hv * v)


def resident_bits(cfg: PaceConfig, shape: ModelShape) -> ResidentBits:
    """The resident bits per state value of `cfg` on `shape`: each term of the paper's accounting and
    the exact stored bits (one sequence)."""
    _check(cfg, shape)
    codes, scales = _formula_terms(cfg, shape)
    c = buffer_c(cfg, shape)
    buffer = c * cfg.decode_period if cfg.buffered else Fraction(0)
    exact = Fraction(8 * state_bytes(cfg, shape, 1), shape.state_values)
    metadata = exact - codes - scales - buffer
    paper = paper_c(cfg, shape)
    formula = codes + scales + (paper * cfg.decode_period if cfg.buffered else 0)
    return ResidentBits(code_bits=float(codes), scale_bits=float(scales), payload_bits=float(codes + scales),
                        metadata_bits=float(metadata), buffer_bits=float(buffer), resident_bits=float(exact),
                        c=float(c), exact_bits=float(exact), paper_c=float(paper), formula_bits=float(formula),
                        sequence_bits=8 * state_bytes_per_sequence(cfg, shape) / shape.state_values)


def state_share(cfg: PaceConfig, shape: ModelShape, n_seq: int, *, weight_bytes_per_param: int | None = None) -> float:
    """The state's share of weights + state memory at `n_seq` sequences (exact state bytes; weights
    ``weight_params · weight_bytes_per_param``, the shape's own value unless given)."""
    _check_n(n_seq)
    per_param = shape.weight_bytes_per_param if weight_bytes_per_param is None else weight_bytes_per_param
    if isinstance(per_param, bool) or not isinstance(per_param, int) or per_param < 1:
        raise PaceError(f"weight_bytes_per_param={per_param!r} is not allowed; allowed: an integer >= 1")
    state = state_bytes(cfg, shape, n_seq)
    total = state + shape.weight_params * per_param
    return state / total if total else 0.0


@dataclass(frozen=True)
class Capacity:
    """How many sequences fit in a memory budget beside the weights (:func:`capacity`)."""

    sequences: int
    weight_bytes: int
    fixed_bytes: int  # stored once however many sequences: head maps, DAMP's row indices
    state_bytes_per_sequence: int
    kv_bytes_per_sequence: int
    state_bytes: int
    state_share: float


def capacity(cfg: PaceConfig, shape: ModelShape, budget_bytes: int, *, weight_bits: int | None = None,
             context: int = 0) -> Capacity:
    """The most concurrent sequences whose recurrent states (exact bytes, :func:`state_bytes`) and, at
    ``context`` tokens each, the full-attention layers' bf16 KV cache (``shape.kv_bytes_per_token``) fit
    in ``budget_bytes`` after the weights (``weight_params · weight_bits / 8``; default the shape's own
    bytes per parameter). ``state_share``: the states' share of the budget at that count."""
    _check_n(budget_bytes, "budget_bytes")
    _check_n(context, "context")
    bits = 8 * shape.weight_bytes_per_param if weight_bits is None else weight_bits
    if isinstance(bits, bool) or not isinstance(bits, int) or bits < 1:
        raise PaceError(f"weight_bits={bits!r} is not allowed; allowed: an integer >= 1 (16 bf16, 8 fp8, 4 int4)")
    weights = -(-shape.weight_params * bits // 8)
    per_state = state_bytes_per_sequence(cfg, shape)
    fixed = state_bytes(cfg, shape, 1) - per_state
    kv = shape.kv_bytes_per_token * context
    n = max((budget_bytes - weights - fixed) // (per_state + kv), 0)
    state = state_bytes(cfg, shape, n) if n else 0
    return Capacity(sequences=n, weight_bytes=weights, fixed_bytes=fixed, state_bytes_per_sequence=per_state,
                    kv_bytes_per_sequence=kv,
                    state_bytes=state, state_share=state / budget_bytes if budget_bytes else 0.0)


def best_in_memory(points: Sequence[Point], configs: Mapping[str, PaceConfig], shape: ModelShape, memory_bytes: int,
                   sequences: int, *, context: int = 0, weight_bits: int | None = None,
                   axis: Axis = KL) -> Point | None:
    """The recommendation for a memory: among the ``points`` whose configuration (``configs[point.config]``, as
    calibrated on the model) holds ``sequences`` sequences of ``context`` tokens in ``memory_bytes`` by
    :func:`capacity`, the best on the quality ``axis`` (:func:`pace_core.frontier.best_under` with no bit budget left
    to it: lowest KL by default; ties: fewer bits, then the name); None when none with a value on the axis fits.

    Like with like: :func:`capacity` takes the weights and what a configuration keeps once per layer or per model
    (head maps, DAMP's row indices, STEPQuant's widths and impact weights, static scales' ranges) from the memory
    first, then counts each sequence's state bytes and attention KV against what is left. One sequence's resident
    bits, which carry the once-per-layer bytes whole, are never set against a per-sequence budget."""
    _check_n(sequences, "sequences")
    if sequences < 1:
        raise PaceError(f"sequences={sequences!r} is not allowed; allowed: an integer >= 1")
    missing = [p.config for p in points if p.config not in configs]
    if missing:
        raise PaceError(f"no configuration for the points {', '.join(missing)}; allowed: one per point")
    fit = [p for p in points if capacity(configs[p.config], shape, memory_bytes, weight_bits=weight_bits,
                                         context=context).sequences >= sequences]
    return best_under(fit, math.inf, axis)


def sequences_that_fit(cfg: PaceConfig, shape: ModelShape, budget_bytes: int) -> int:
    """The most sequences whose resident state fits in `budget_bytes` after the weights
    (``shape.weight_bytes``); 0 when the weights alone do not fit (:func:`capacity` without KV)."""
    return capacity(cfg, shape, budget_bytes).sequences
