"""Every PACE setting in one validated, frozen dataclass; the named configurations of PACE_SPEC §6;
JSON export/import.

A :class:`PaceConfig` is valid from construction on (``__post_init__`` validates; bad input raises
:class:`~pace_core.errors.PaceError` naming the field and its allowed values). What depends on a
model (a group size dividing the real axis, the per-layer 8-bit heads) is checked by
:meth:`PaceConfig.validate_for`.

Two JSON forms. The complete record (:func:`config_to_dict`, ``schema_version`` 3, every field) is what
result caches key on and results store. The deployable export (``schema_version`` 4,
:mod:`pace_core.export`) adds the model, the state layout and the resident bits and keeps only the
settings the method reads; :func:`document_from_json` reads both. The record is shaped like
compressed-tensors' ``kv_cache_scheme``
(``QuantizationArgs``: ``num_bits``, ``type``, ``symmetric``, ``strategy``, ``group_size``,
``scale_dtype``, ``zp_dtype``) under the key ``state_cache_scheme``, with the PACE settings under
``pace``::

    {"schema_version": 3,
     "producer": {"name": "pace-studio", "version": "0.1.0"},
     "model": "qwen3.5-27b" | null,
     "state_cache_scheme": {"num_bits": 4, "type": "int", "symmetric": false, "strategy": "group",
                            "group_size": 32, "scale_dtype": "float16", "zp_dtype": "int4"},
     "pace": {"name": "pace-4-8", "method": "pace", "group_axis": "key", "decode_period": 8,
              "prefill_period": 256, "buffer_precision": "mixed", "high_bits": 8, "high_share": 0.25,
              "high_heads": {"0": [3, 17, ...], "1": [...]} | null, "reference_dtype": "float32",
              "damp_outlier_rows": 16, "damp_hadamard": true, "prefill_after_decode": "flush"},
     "provenance": {...}}

``type`` is ``"float"`` for the references (method ``none``, ``num_bits`` 32 or 16). ``strategy`` is
``"group"`` for rtn / pace / damp, ``"channel"`` for Q-Mamba DSQ (a row and a column scale per
matrix) and ``null`` for the references; ``group_size`` is always written (DSQ and the references
do not use it). ``zp_dtype`` is ``"int<b>"`` (zero points stored in b bits) with zero points and
``null`` when symmetric. ``high_heads`` keys are GDN-layer ordinals ``"0".."L-1"`` (the order of the
model's GDN layers, not the decoder-layer index). Import checks every field and rejects unknown keys
in ``state_cache_scheme`` and ``pace``; ``producer`` and ``provenance`` are free-form objects. A configuration
from outside (a file, the app, the CLI) is admitted by :func:`pace_core.export.admit`, which reads it here.
``config_from_dict(config_to_dict(c)) == c`` for every valid config. Schema 1 (PACE Studio before
``prefill_after_decode``) is still read: its documents have no ``pace.prefill_after_decode`` and get
``"flush"``, the behaviour they were made with.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pace_core import __version__
from pace_core.buffer import BufferFormat
from pace_core.errors import PaceError
from pace_core.quant import GROUP_AXES, GroupAxis, QuantSpec

if TYPE_CHECKING:
    from pace_core.shapes import ModelShape

BufferPrecision = Literal["fp32", "bf16", "int8", "mixed"]  # mixed: keys 4-bit, values bf16
Method = Literal["none", "rtn", "pace", "damp", "dsq"]  # none = fp32/bf16 reference
PrefillAfterDecode = Literal["flush", "carry"]

METHODS: tuple[str, ...] = ("none", "rtn", "pace", "damp", "dsq")
BUFFER_PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "int8", "mixed")
PREFILL_AFTER_DECODE: tuple[str, ...] = ("flush", "carry")
REFERENCE_DTYPES: dict[str, int] = {"float32": 32, "bfloat16": 16}
"""Reference dtype -> its bits (the ``bits`` of a method ``none`` config)."""
SCALE_DTYPES: tuple[str, ...] = ("float16",)
QUANT_BITS: tuple[int, ...] = tuple(range(2, 9))
GROUP_SIZES_NO_SHAPE: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
"""Group sizes allowed before a model is known: powers of two dividing 128 (Qwen's d_k = d_v)."""
MAX_DECODE_PERIOD = 4096
MAX_PREFILL_PERIOD = 1 << 20
MAX_DAMP_OUTLIER_ROWS = 128
HIGH_SHARE_METHODS: tuple[str, ...] = ("rtn", "pace")
"""Methods whose heads may be split into low- and high-bit heads."""

SCHEMA_VERSION = 3
"""The schema of the complete record (:func:`config_to_dict`), which result caches key on."""
READ_SCHEMA_VERSION = 4
"""The newest schema read: the deployable export of :mod:`pace_core.export`."""
PRODUCER_NAME = "pace-studio"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def num_high_heads(share: float, num_heads: int) -> int:
    """Heads per layer kept at ``high_bits``: ``share · num_heads`` rounded half up (¼ of 48 = 12)."""
    return math.floor(share * num_heads + 0.5)


@dataclass(frozen=True)
class PaceConfig:
    """One PACE (or baseline) configuration; valid from construction on.

    Fields (PACE_SPEC §2–§6; ``[ours]`` choices documented in the spec):

    - ``method``: ``none`` (full-precision reference), ``rtn`` (uniform round to nearest), ``pace``,
      ``damp`` (outlier key rows in fp16, rest INT-b), ``dsq`` (Q-Mamba row × column scales).
    - ``bits``: 2..8 state bits of the (low-precision) heads; 32 or 16 for ``none``, matching
      ``reference_dtype`` (float32 / bfloat16).
    - ``high_bits`` (``bits``..8), ``high_share`` in [0, 1]: the share of heads per layer kept at
      ``high_bits`` (rtn and pace only); ``high_heads``: per GDN layer (GDN-layer order) the sorted
      indices of those heads, from calibration (:func:`pace_core.heads.allocate_high_heads`).
    - ``symmetric`` (False = integer zero point in b bits; damp and dsq are symmetric),
      ``group_axis`` (key = channel-aligned, value = baseline; damp groups along value),
      ``group_size`` (a power of two dividing 128 here; :meth:`validate_for` checks the real axis),
      ``scale_dtype`` (float16).
    - ``decode_period`` dP in 1..4096 (1 = per-token rounding, no decode buffer),
      ``prefill_period`` P in 1..2^20, ``buffer``: decode-buffer precision.
    - ``damp_outlier_rows`` (0..128, at most d_k), ``damp_hadamard``.
    - ``prefill_after_decode`` **[ours]** (the spec does not say how a prompt continues after
      decoded tokens, e.g. a user's next turn): ``flush`` folds the buffered records into the
      checkpoint and rounds it (one extra rounding, at a point that need not be a multiple of dP),
      then the prompt runs in P-token segments from that checkpoint; ``carry`` runs the prompt from
      the exact state (checkpoint plus folded buffer, not rounded), so its first rounding is the end
      of its first segment. Either way the segments count from the start of the prompt.
    - ``exact_current_token`` **[ours]**: the current token's output and its record's correction use its
      exact ``k_t, u_t`` (at hand when it is processed); its record is stored in the buffer's precision
      for the later tokens and the fold either way. False: the current token reads its own stored record
      (PACE Studio before schema 3).
    - ``buffer_key_group``, ``buffer_value_group`` **[ours]**: entries per fp16 scale along each buffered
      key / value vector of an integer buffer part (0: one scale per vector); ``buffer_key_symmetric``,
      ``buffer_value_symmetric``: False gives each group an integer zero point. Float parts ignore them.
      The named defaults were chosen by measurement on held-out text (WikiText-2 validation, first 8192
      tokens, embedded model; ``python -m pace_core perplexity``): PACE-4's int8 buffer keeps one scale
      per vector (groups of 32 or 16, with or without zero points, changed KL by under 5%: 3.17e-4 vs
      3.03-3.08e-4), PACE-4/8's 4-bit buffer keys use groups of 16 with zero points (KL 1.24e-3 per vector,
      7.3e-4 groups of 32, 3.9e-4 groups of 32 with zero points, 2.5e-4 groups of 16 with zero points,
      which is below PACE-4's; top-1 agreement 98.2% -> 99.1%). pace_core.accounting relates them to the
      paper's figures.
    """

    name: str = "custom"
    method: Method = "pace"
    bits: int = 4
    high_bits: int = 8
    high_share: float = 0.0
    symmetric: bool = True
    group_axis: GroupAxis = "key"
    group_size: int = 64
    scale_dtype: str = "float16"
    decode_period: int = 8
    prefill_period: int = 256
    buffer: BufferPrecision = "int8"
    reference_dtype: str = "float32"
    damp_outlier_rows: int = 16
    damp_hadamard: bool = True
    high_heads: tuple[tuple[int, ...], ...] | None = None
    prefill_after_decode: PrefillAfterDecode = "flush"
    exact_current_token: bool = True
    buffer_key_group: int = 0
    buffer_value_group: int = 0
    buffer_key_symmetric: bool = True
    buffer_value_symmetric: bool = True

    def __post_init__(self) -> None:
        if _is_int(self.high_share):
            object.__setattr__(self, "high_share", float(self.high_share))
        if isinstance(self.high_heads, (list, tuple)):
            object.__setattr__(self, "high_heads", tuple(
                tuple(layer) if isinstance(layer, (list, tuple)) else layer for layer in self.high_heads))
        self.validate()

    @property
    def quantized(self) -> bool:
        """True unless this is a full-precision reference (method ``none``)."""
        return self.method != "none"

    @property
    def exact(self) -> bool:
        """True when storing the state changes nothing (method ``none`` in float32): the fp32 reference."""
        return self.method == "none" and self.reference_dtype == "float32"

    @property
    def needs_heads(self) -> bool:
        """True when a share of heads is kept at ``high_bits`` without saying which (PACE-4/8 before a
        calibration on the model chooses them)."""
        return self.high_share > 0 and self.high_heads is None

    @property
    def needs_calibration(self) -> bool:
        """True when running this configuration needs a calibration on the model first: :attr:`needs_heads`,
        or DAMP (its outlier rows are chosen on the model and are not part of a configuration)."""
        return self.needs_heads or self.method == "damp"

    @property
    def buffered(self) -> bool:
        """True when decoding keeps a buffer: dP > 1, for every method (method none buffers too and
        casts to its reference dtype at each flush)."""
        return self.decode_period > 1

    @property
    def buffer_format(self) -> BufferFormat:
        """How the decode buffer stores a record (:class:`pace_core.buffer.BufferFormat`)."""
        return BufferFormat(self.buffer, self.buffer_key_group, self.buffer_value_group, self.buffer_key_symmetric,
                            self.buffer_value_symmetric)

    def validate(self) -> PaceConfig:
        """Check every field; raise PaceError naming the field and its allowed values. Returns self."""
        if not isinstance(self.name, str) or not self.name.strip():
            raise PaceError(f"name={self.name!r} is not allowed; allowed: a non-empty string")
        _check_choice("method", self.method, METHODS)
        _check_choice("reference_dtype", self.reference_dtype, tuple(REFERENCE_DTYPES))
        if self.quantized:
            _check_int("bits", self.bits, QUANT_BITS, f"integers 2..8 for method {self.method!r}")
        elif self.bits != REFERENCE_DTYPES[self.reference_dtype] or not _is_int(self.bits):
            raise PaceError(
                f"bits={self.bits!r} is not allowed for method 'none' with reference_dtype "
                f"{self.reference_dtype!r}; allowed: {REFERENCE_DTYPES[self.reference_dtype]} "
                "(32 with float32, 16 with bfloat16)")
        low = self.bits if self.quantized else 2
        _check_int("high_bits", self.high_bits, range(low, 9), f"integers {low}..8 (at least bits)")
        if not isinstance(self.high_share, float) or not 0.0 <= self.high_share <= 1.0:
            raise PaceError(f"high_share={self.high_share!r} is not allowed; allowed: a number in [0, 1]")
        if self.high_share > 0 and self.method not in HIGH_SHARE_METHODS:
            raise PaceError(f"high_share={self.high_share} is not allowed for method {self.method!r}; "
                            f"allowed: 0 (high-bit heads exist for methods {', '.join(HIGH_SHARE_METHODS)})")
        _check_choice("symmetric", self.symmetric, (True, False))
        if not self.symmetric and self.method in ("damp", "dsq"):
            raise PaceError(f"symmetric=False is not allowed for method {self.method!r}; allowed: True")
        _check_choice("group_axis", self.group_axis, GROUP_AXES)
        if self.method == "damp" and self.group_axis != "value":
            raise PaceError("group_axis='key' is not allowed for method 'damp'; allowed: 'value' "
                            "(DAMP groups the non-outlier rows along the value axis)")
        _check_int("group_size", self.group_size, GROUP_SIZES_NO_SHAPE,
                   "powers of two dividing 128: " + ", ".join(map(str, GROUP_SIZES_NO_SHAPE)))
        _check_choice("scale_dtype", self.scale_dtype, SCALE_DTYPES)
        _check_int("decode_period", self.decode_period, range(1, MAX_DECODE_PERIOD + 1),
                   f"integers 1..{MAX_DECODE_PERIOD}")
        _check_int("prefill_period", self.prefill_period, range(1, MAX_PREFILL_PERIOD + 1),
                   f"integers 1..{MAX_PREFILL_PERIOD}")
        _check_choice("buffer", self.buffer, BUFFER_PRECISIONS)
        _check_int("damp_outlier_rows", self.damp_outlier_rows, range(MAX_DAMP_OUTLIER_ROWS + 1),
                   f"integers 0..{MAX_DAMP_OUTLIER_ROWS} (at most d_k)")
        _check_choice("damp_hadamard", self.damp_hadamard, (True, False))
        _check_choice("prefill_after_decode", self.prefill_after_decode, PREFILL_AFTER_DECODE)
        _check_choice("exact_current_token", self.exact_current_token, (True, False))
        for part in ("key", "value"):
            _check_int(f"buffer_{part}_group", getattr(self, f"buffer_{part}_group"), (0, *GROUP_SIZES_NO_SHAPE),
                       "0 (one group per vector) or a power of two dividing 128: "
                       + ", ".join(map(str, GROUP_SIZES_NO_SHAPE)))
            _check_choice(f"buffer_{part}_symmetric", getattr(self, f"buffer_{part}_symmetric"), (True, False))
        self._validate_high_heads()
        return self

    def _validate_high_heads(self) -> None:
        heads = self.high_heads
        if heads is None:
            return
        allowed = "allowed: None or one tuple of distinct, ascending head indices >= 0 per GDN layer"
        if self.high_share == 0:
            raise PaceError(f"high_heads is set but high_share is 0; {allowed} with high_share > 0")
        if not isinstance(heads, tuple) or not heads:
            raise PaceError(f"high_heads={heads!r} is not allowed; {allowed}")
        for i, layer in enumerate(heads):
            if (not isinstance(layer, tuple) or not all(_is_int(h) and h >= 0 for h in layer)
                    or list(layer) != sorted(set(layer))):
                raise PaceError(f"high_heads[{i}]={layer!r} is not allowed; {allowed}")

    def validate_for(self, shape: ModelShape) -> PaceConfig:
        """Check the settings that depend on a model: the group size divides the grouped axis, DAMP's
        outlier rows fit d_k (and d_v is a power of two for its Hadamard transform), and
        ``high_heads`` has one entry per GDN layer with ``num_high_heads(high_share, HV)`` valid head
        indices. Returns self."""
        if self.method in ("rtn", "pace", "damp"):
            axis_len = shape.d_k if self.group_axis == "key" else shape.d_v
            axis_name = "d_k" if self.group_axis == "key" else "d_v"
            if axis_len % self.group_size:
                allowed = [d for d in GROUP_SIZES_NO_SHAPE if axis_len % d == 0]
                raise PaceError(
                    f"group_size={self.group_size} does not divide the {self.group_axis} axis of "
                    f"{shape.name} ({axis_name}={axis_len}); allowed: {', '.join(map(str, allowed))}")
        for part, length, name in (("key", shape.d_k, "d_k"), ("value", shape.d_v, "d_v")):
            group = getattr(self, f"buffer_{part}_group")
            if group and length % group:
                allowed = [0] + [d for d in GROUP_SIZES_NO_SHAPE if length % d == 0]
                raise PaceError(f"buffer_{part}_group={group} does not divide the buffered {part}s of {shape.name} "
                                f"({name}={length}); allowed: {', '.join(map(str, allowed))}")
        if self.method == "damp":
            if self.damp_outlier_rows > shape.d_k:
                raise PaceError(f"damp_outlier_rows={self.damp_outlier_rows} exceeds d_k={shape.d_k} of "
                                f"{shape.name}; allowed: 0..{shape.d_k}")
            if self.damp_hadamard and shape.d_v & (shape.d_v - 1):
                raise PaceError(f"damp_hadamard=True needs a power-of-two d_v; {shape.name} has "
                                f"d_v={shape.d_v}; allowed: damp_hadamard=False")
        return self.validate_heads_for(shape)

    def validate_heads_for(self, shape: ModelShape) -> PaceConfig:
        """Check that ``high_heads`` (when set) has one entry per GDN layer of ``shape`` with
        ``num_high_heads(high_share, HV)`` valid head indices. Returns self."""
        if self.high_heads is not None:
            want = num_high_heads(self.high_share, shape.num_v_heads)
            if len(self.high_heads) != shape.num_gdn_layers:
                raise PaceError(f"high_heads has {len(self.high_heads)} layers; allowed: one per GDN layer "
                                f"of {shape.name} ({shape.num_gdn_layers})")
            for i, layer in enumerate(self.high_heads):
                if len(layer) != want or (layer and layer[-1] >= shape.num_v_heads):
                    raise PaceError(
                        f"high_heads[{i}]={layer!r} is not allowed for {shape.name}; allowed: {want} "
                        f"distinct head indices in 0..{shape.num_v_heads - 1} (high_share={self.high_share})")
        return self

    def replace(self, **changes: Any) -> PaceConfig:
        """A validated copy with `changes` applied (unknown field names raise PaceError)."""
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - fields)
        if unknown:
            raise PaceError(f"unknown setting(s) {', '.join(unknown)}; allowed: {', '.join(sorted(fields))}")
        return dataclasses.replace(self, **changes)

    def quant_spec(self, bits: int | None = None) -> QuantSpec:
        """The group quantiser of this config at `bits` (default: the low bits ``self.bits``)."""
        if self.method not in ("rtn", "pace", "damp"):
            raise PaceError(f"method {self.method!r} has no group quantiser; allowed: rtn, pace, damp")
        return QuantSpec(bits=self.bits if bits is None else bits, symmetric=self.symmetric,
                         axis=self.group_axis, group_size=self.group_size)

    def head_bits(self, gdn_layer: int, num_v_heads: int) -> tuple[int, ...]:
        """Bits of each value head `[HV]` of GDN layer `gdn_layer` (GDN-layer order)."""
        if not self.quantized:
            raise PaceError("method 'none' stores no quantised heads; allowed: a quantised method")
        if self.high_share == 0:
            return (self.bits,) * num_v_heads
        if self.high_heads is None:
            raise PaceError(f"high_share={self.high_share} needs high_heads from calibration "
                            "(pace_core.heads.allocate_high_heads); allowed: a config with high_heads")
        if not 0 <= gdn_layer < len(self.high_heads):
            raise PaceError(f"gdn_layer={gdn_layer} is out of range; allowed: 0..{len(self.high_heads) - 1}")
        high = set(self.high_heads[gdn_layer])
        return tuple(self.high_bits if h in high else self.bits for h in range(num_v_heads))


def _check_choice(field: str, value: Any, allowed: tuple) -> None:
    ok = any(value is a if isinstance(a, bool) else (type(value) is type(a) and value == a) for a in allowed)
    if not ok:
        raise PaceError(f"{field}={value!r} is not allowed; allowed: {', '.join(map(repr, allowed))}")


def _check_int(field: str, value: Any, allowed: range | tuple, text: str) -> None:
    if not _is_int(value) or value not in allowed:
        raise PaceError(f"{field}={value!r} is not allowed; allowed: {text}")


# The per-token baselines (dP = 1) carry buffer "int8": unused at dP = 1, it is the buffer of their
# "every dP" variants (spec §6: "RTN-INTb, dP ... int8"), so raising decode_period gives that variant.
def _rtn(bits: int) -> PaceConfig:
    return PaceConfig(name=f"rtn-int{bits}", method="rtn", bits=bits, group_axis="value", group_size=32,
                      symmetric=True, decode_period=1, buffer="int8")


def _damp(bits: int) -> PaceConfig:
    return PaceConfig(name=f"damp-int{bits}", method="damp", bits=bits, group_axis="value", group_size=32,
                      symmetric=True, decode_period=1, buffer="int8", damp_outlier_rows=16, damp_hadamard=True)


NAMED_CONFIGS: dict[str, PaceConfig] = {
    "fp32": PaceConfig(name="fp32", method="none", bits=32, reference_dtype="float32", decode_period=1, buffer="fp32"),
    "bf16": PaceConfig(name="bf16", method="none", bits=16, reference_dtype="bfloat16", decode_period=1, buffer="fp32"),
    **{f"rtn-int{b}": _rtn(b) for b in QUANT_BITS},
    "pace-4": PaceConfig(name="pace-4", method="pace", bits=4, group_axis="key", group_size=64, symmetric=True,
                         decode_period=8, prefill_period=256, buffer="int8"),
    "pace-4-8": PaceConfig(name="pace-4-8", method="pace", bits=4, high_bits=8, high_share=0.25, group_axis="key",
                           group_size=32, symmetric=False, decode_period=8, prefill_period=256, buffer="mixed",
                           buffer_key_group=16, buffer_key_symmetric=False),
    "damp-int8": _damp(8),
    "damp-int4": _damp(4),
    "qmamba-dsq": PaceConfig(name="qmamba-dsq", method="dsq", bits=4, symmetric=True, group_axis="value",
                             group_size=32, decode_period=1, buffer="int8"),
}
"""The named configurations of PACE_SPEC §6 (starting points; every field can be changed)."""


def get_config(name: str) -> PaceConfig:
    """The named configuration `name` (case-insensitive); unknown names raise PaceError listing them."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in NAMED_CONFIGS:
        raise PaceError(f"config {name!r} is unknown; allowed: {', '.join(NAMED_CONFIGS)}")
    return NAMED_CONFIGS[key]


def _strategy(method: str) -> str | None:
    return {"none": None, "dsq": "channel"}.get(method, "group")


def config_to_dict(cfg: PaceConfig, *, model: str | None = None, provenance: dict | None = None) -> dict:
    """The JSON document (a dict of plain JSON types) of `cfg` for `model`, with `provenance`."""
    if not isinstance(cfg, PaceConfig):
        raise PaceError(f"cfg must be a PaceConfig; got {type(cfg).__name__}")
    if model is not None and not isinstance(model, str):
        raise PaceError(f"model={model!r} is not allowed; allowed: a string or None")
    if provenance is not None and not isinstance(provenance, dict):
        raise PaceError(f"provenance={provenance!r} is not allowed; allowed: a JSON object (dict) or None")
    return {
        "schema_version": SCHEMA_VERSION,
        "producer": {"name": PRODUCER_NAME, "version": __version__},
        "model": model,
        "state_cache_scheme": {
            "num_bits": cfg.bits,
            "type": "int" if cfg.quantized else "float",
            "symmetric": cfg.symmetric,
            "strategy": _strategy(cfg.method),
            "group_size": cfg.group_size,
            "scale_dtype": cfg.scale_dtype,
            "zp_dtype": None if cfg.symmetric or not cfg.quantized else f"int{cfg.bits}",
        },
        "pace": {
            "name": cfg.name,
            "method": cfg.method,
            "group_axis": cfg.group_axis,
            "decode_period": cfg.decode_period,
            "prefill_period": cfg.prefill_period,
            "buffer_precision": cfg.buffer,
            "high_bits": cfg.high_bits,
            "high_share": cfg.high_share,
            "high_heads": None if cfg.high_heads is None
            else {str(i): list(layer) for i, layer in enumerate(cfg.high_heads)},
            "reference_dtype": cfg.reference_dtype,
            "damp_outlier_rows": cfg.damp_outlier_rows,
            "damp_hadamard": cfg.damp_hadamard,
            "prefill_after_decode": cfg.prefill_after_decode,
            "exact_current_token": cfg.exact_current_token,
            "buffer_key_group": cfg.buffer_key_group,
            "buffer_value_group": cfg.buffer_value_group,
            "buffer_key_symmetric": cfg.buffer_key_symmetric,
            "buffer_value_symmetric": cfg.buffer_value_symmetric,
        },
        "provenance": dict(provenance or {}),
    }


_SCHEME_KEYS = ("num_bits", "type", "symmetric", "strategy", "group_size", "scale_dtype", "zp_dtype")
_PACE_KEYS = ("name", "method", "group_axis", "decode_period", "prefill_period", "buffer_precision", "high_bits",
              "high_share", "high_heads", "reference_dtype", "damp_outlier_rows", "damp_hadamard",
              "prefill_after_decode", "exact_current_token", "buffer_key_group", "buffer_value_group",
              "buffer_key_symmetric", "buffer_value_symmetric")
_PACE_KEYS_BY_SCHEMA = {1: _PACE_KEYS[:12], 2: _PACE_KEYS[:13], 3: _PACE_KEYS}
_OLDER_SCHEMA_VALUES = {"prefill_after_decode": "flush", "exact_current_token": False, "buffer_key_group": 0,
                        "buffer_value_group": 0, "buffer_key_symmetric": True, "buffer_value_symmetric": True}
"""What documents of an older schema were made with: schema 1 had no prefill_after_decode (flush), schemas 1
and 2 no exact current token and one symmetric scale per buffered vector."""
_TOP_KEYS = ("schema_version", "producer", "model", "state_cache_scheme", "pace", "provenance")


def _section(d: dict, key: str, keys: tuple[str, ...]) -> dict:
    sec = d[key]
    if not isinstance(sec, dict):
        raise PaceError(f"config JSON field {key!r} must be an object; got {type(sec).__name__}")
    missing = [k for k in keys if k not in sec]
    unknown = [k for k in sec if k not in keys]  # in the document's order
    if missing:
        raise PaceError(f"config JSON field {key}.{missing[0]} is missing; required: {', '.join(keys)}")
    if unknown:
        raise PaceError(f"config JSON field{'s' if len(unknown) > 1 else ''} {', '.join(f'{key}.{u}' for u in unknown)} "
                        f"{'are' if len(unknown) > 1 else 'is'} unknown; allowed: {', '.join(keys)}")
    return sec


def _high_heads_from_json(value: Any) -> tuple[tuple[int, ...], ...] | None:
    if value is None:
        return None
    allowed = 'allowed: null or an object {"0": [head, ...], "1": [...], ...} with one key per GDN layer'
    if not isinstance(value, dict) or not value:
        raise PaceError(f"config JSON field pace.high_heads={value!r} is not allowed; {allowed}")
    if sorted(value) != sorted(str(i) for i in range(len(value))):
        raise PaceError(f"config JSON field pace.high_heads has keys {sorted(value)}; {allowed} "
                        f"(keys 0..{len(value) - 1})")
    layers = []
    for i in range(len(value)):
        layer = value[str(i)]
        if not isinstance(layer, list) or not all(_is_int(h) for h in layer):
            raise PaceError(f'config JSON field pace.high_heads["{i}"]={layer!r} is not allowed; '
                            "allowed: a list of integer head indices")
        layers.append(tuple(layer))
    return tuple(layers)


def config_from_dict(d: dict) -> PaceConfig:
    """The PaceConfig of a configuration document (:func:`document_from_dict`)."""
    return document_from_dict(d).config


def document_from_dict(d: dict) -> ConfigDocument:
    """A configuration document: a complete record made by :func:`config_to_dict` (schema 1..3) or a
    deployable export (schema 4, :mod:`pace_core.export`).

    Malformed documents raise PaceError naming the field and what is allowed; a document of a newer
    schema version is rejected (written by a newer PACE Studio)."""
    newest = READ_SCHEMA_VERSION
    if not isinstance(d, dict):
        raise PaceError(f"config JSON must be an object; got {type(d).__name__}")
    if "schema_version" not in d:
        raise PaceError(f"config JSON field schema_version is missing; allowed: 1..{newest}")
    version = d["schema_version"]
    if not _is_int(version) or version < 1:
        raise PaceError(f"config JSON field schema_version={version!r} is not allowed; allowed: 1..{newest}")
    if version > newest:
        raise PaceError(f"config JSON field schema_version={version} is newer than this PACE Studio "
                        f"understands; allowed: 1..{newest} (update pace-studio)")
    if version == newest:
        from pace_core.export import document_from_export

        return document_from_export(d)
    missing = [k for k in _TOP_KEYS if k not in d]
    if missing:
        raise PaceError(f"config JSON field {missing[0]} is missing; required: {', '.join(_TOP_KEYS)}")
    for key in ("producer", "provenance"):
        if not isinstance(d[key], dict):
            raise PaceError(f"config JSON field {key} must be an object; got {type(d[key]).__name__}")
    if d["model"] is not None and not isinstance(d["model"], str):
        raise PaceError(f"config JSON field model={d['model']!r} is not allowed; allowed: a string or null")
    pace = {**_OLDER_SCHEMA_VALUES, **_section(d, "pace", _PACE_KEYS_BY_SCHEMA[version])}
    cfg = config_from_sections(d["state_cache_scheme"], pace, high_heads=_high_heads_from_json(pace["high_heads"]))
    return ConfigDocument(cfg, d["model"], d["producer"], d["provenance"])


def config_from_sections(scheme: Any, pace: dict, *, high_heads: tuple[tuple[int, ...], ...] | None) -> PaceConfig:
    """The PaceConfig of a ``state_cache_scheme`` object (its keys checked here) and a complete ``pace``
    object (every key of the current schema; ``high_heads`` already decoded), checked against each other."""
    scheme = _section({"state_cache_scheme": scheme}, "state_cache_scheme", _SCHEME_KEYS)
    _check_choice("config JSON field state_cache_scheme.type", scheme["type"], ("int", "float"))
    if (scheme["type"] == "float") != (pace["method"] == "none"):
        raise PaceError(f"config JSON field state_cache_scheme.type={scheme['type']!r} does not match "
                        f"pace.method={pace['method']!r}; allowed: 'float' for method none, 'int' otherwise")
    try:
        cfg = PaceConfig(
            name=pace["name"], method=pace["method"], bits=scheme["num_bits"], high_bits=pace["high_bits"],
            high_share=pace["high_share"], symmetric=scheme["symmetric"], group_axis=pace["group_axis"],
            group_size=scheme["group_size"], scale_dtype=scheme["scale_dtype"],
            decode_period=pace["decode_period"], prefill_period=pace["prefill_period"],
            buffer=pace["buffer_precision"], reference_dtype=pace["reference_dtype"],
            damp_outlier_rows=pace["damp_outlier_rows"], damp_hadamard=pace["damp_hadamard"],
            high_heads=high_heads, prefill_after_decode=pace["prefill_after_decode"],
            exact_current_token=pace["exact_current_token"], buffer_key_group=pace["buffer_key_group"],
            buffer_value_group=pace["buffer_value_group"], buffer_key_symmetric=pace["buffer_key_symmetric"],
            buffer_value_symmetric=pace["buffer_value_symmetric"])
    except PaceError as e:
        raise PaceError(f"config JSON: {e}") from None
    expected = config_to_dict(cfg)["state_cache_scheme"]
    for key in ("strategy", "zp_dtype"):
        if scheme[key] != expected[key]:
            raise PaceError(f"config JSON field state_cache_scheme.{key}={scheme[key]!r} does not match the "
                            f"other settings; allowed: {expected[key]!r}")
    return cfg


def config_to_json(cfg: PaceConfig, *, model: str | None = None, provenance: dict | None = None,
                   indent: int | None = 2) -> str:
    """JSON text of :func:`config_to_dict`."""
    return json.dumps(config_to_dict(cfg, model=model, provenance=provenance), indent=indent)


def config_from_json(s: str) -> PaceConfig:
    """The PaceConfig of JSON text; malformed JSON raises PaceError with the line and column."""
    return document_from_json(s).config


@dataclass(frozen=True)
class ConfigDocument:
    """A parsed config JSON document: the config plus its model (a path or hub id; ``model_info``: the
    export's whole model object, with the fingerprint and shape, or None), producer and provenance."""

    config: PaceConfig
    model: str | None
    producer: dict
    provenance: dict
    model_info: dict | None = None


def document_from_json(s: str) -> ConfigDocument:
    """Parse config JSON text (any schema :func:`document_from_dict` reads)."""
    return document_from_dict(parse_json(s))


def parse_json(s: str) -> Any:
    """JSON text -> Python objects; PaceError in the user's words when it is not JSON."""
    if not isinstance(s, str):
        raise PaceError(f"config JSON must be text; got {type(s).__name__}")
    try:
        return json.loads(s)
    except json.JSONDecodeError as e:
        raise PaceError(f"this is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); expected a "
                        "PACE configuration as the Export page or `python -m pace_core export` writes it") from None
    except RecursionError:
        raise PaceError("this JSON is nested too deeply to read; expected a PACE configuration as the Export "
                        "page or `python -m pace_core export` writes it") from None
