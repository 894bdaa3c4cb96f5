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
from typing import TYPE_CHECKING, Any, Callable, Literal

from pace_core import __version__
from pace_core.buffer import BufferFormat
from pace_core.errors import PaceError
from pace_core.methods import COMBINATIONS, Calibrated, method_of
from pace_core.methods import METHODS as _METHODS
from pace_core.methods.groups import STATIC_MARGIN
from pace_core.quant import GROUP_AXES, GroupAxis, QuantSpec
from pace_core.settings import Setting

if TYPE_CHECKING:
    from pace_core.shapes import ModelShape

BufferPrecision = Literal["fp32", "bf16", "int8", "mixed"]  # mixed: keys 4-bit, values bf16
PrefillAfterDecode = Literal["flush", "carry"]
Rounding = Literal["nearest", "stochastic"]
Scales = Literal["dynamic", "static"]

METHODS: tuple[str, ...] = tuple(_METHODS)
"""The methods' names (:mod:`pace_core.methods`), ``none`` the full-precision references."""
BUFFER_PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "int8", "mixed")
PREFILL_AFTER_DECODE: tuple[str, ...] = ("flush", "carry")
ROUNDINGS: tuple[str, ...] = ("nearest", "stochastic")
SCALES: tuple[str, ...] = ("dynamic", "static")
MAX_ROUNDING_SEED = 2**16 - 1
"""Seeds 0..65535: a layer's generator is seeded with ``seed · 2^16 + GDN layer`` (torch's CPU generator keeps 32 bits)."""
STATIC_MARGINS = (0.25, 16.0)
"""The static scales' margins allowed: a factor on the calibrated ranges (below 1 it clips them)."""
REFERENCE_DTYPES: dict[str, int] = {"float32": 32, "bfloat16": 16}
"""Reference dtype -> its bits (the ``bits`` of a method ``none`` config)."""
SCALE_DTYPES: tuple[str, ...] = ("float16",)
QUANT_BITS: tuple[int, ...] = tuple(range(2, 9))
GROUP_SIZES_NO_SHAPE: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
"""Group sizes allowed before a model is known: powers of two dividing 128 (Qwen's d_k = d_v)."""
MAX_DECODE_PERIOD = 4096
MAX_PREFILL_PERIOD = 1 << 20
MAX_DAMP_OUTLIER_ROWS = 128
HIGH_SHARE_METHODS: tuple[str, ...] = tuple(name for name, m in _METHODS.items() if m.head_widths)
"""Methods whose heads may be split into low- and high-bit heads."""

SCHEMA_VERSION = 6
"""The schema of the complete record (:func:`config_to_dict`), which result caches key on: 1-3, then 5 (4 is the
first deployable export's; from 5 on records and exports share the numbers and differ by the export's ``kind``);
6 adds the combinations (stochastic rounding, key rotation, static scales)."""
READ_SCHEMA_VERSION = 7
"""The newest schema read: of exports (:mod:`pace_core.export`, 7 records the codes' packing); records go up to
:data:`SCHEMA_VERSION`."""
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
    - ``calibrated``: the method's per-layer tensors calibrated on one model (:attr:`Method.calibration
      <pace_core.methods.Method.calibration>`: DAMP's outlier rows, static scales' ranges), None until a
      calibration on the model.
    - the combinations the PACE paper did not test (:data:`pace_core.methods.COMBINATIONS`; each method takes
      those in its ``composes``, :mod:`pace_core.methods.groups`): ``rounding`` (``nearest``: half to even;
      ``stochastic``: ``floor(x/s + u)``) with ``rounding_seed`` (0..65535); ``key_hadamard`` (store ``Q(H S)``,
      H the Sylvester Hadamard along the key axis); ``scales`` (``dynamic``: each checkpoint's own; ``static``:
      calibrated once per layer) with ``static_margin`` (the calibrated ranges' factor, 0.25..16: below 1 it clips them).
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
    method: str = "pace"
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
    rounding: Rounding = "nearest"
    rounding_seed: int = 0
    key_hadamard: bool = False
    scales: Scales = "dynamic"
    static_margin: float = STATIC_MARGIN
    calibrated: Calibrated | None = None
    options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        for name in ("high_share", "static_margin"):
            if _is_int(getattr(self, name)):
                object.__setattr__(self, name, float(getattr(self, name)))
        if isinstance(self.high_heads, (list, tuple)):
            object.__setattr__(self, "high_heads", tuple(
                tuple(layer) if isinstance(layer, (list, tuple)) else layer for layer in self.high_heads))
        object.__setattr__(self, "options", _options(self.options))
        self.validate()

    def __getattr__(self, name: str) -> Any:
        """A method's own setting (:data:`METHOD_SETTINGS`), read like a field: its value in ``options``, else its
        default."""
        setting = METHOD_SETTINGS.get(name)
        if setting is None or name == "options":
            raise AttributeError(f"{type(self).__name__!r} has no setting {name!r}")
        return dict(self.options).get(name, setting.default)

    @property
    def quantized(self) -> bool:
        """True unless this is a full-precision reference (method ``none``)."""
        return method_of(self).quantized

    @property
    def exact(self) -> bool:
        """True when storing the state changes nothing (a reference in float32): the fp32 reference."""
        return not self.quantized and self.reference_dtype == "float32"

    @property
    def needs_heads(self) -> bool:
        """True when a share of heads is kept at ``high_bits`` without saying which (PACE-4/8 before a
        calibration on the model chooses them)."""
        return self.high_share > 0 and self.high_heads is None

    @property
    def needs_calibration(self) -> bool:
        """True when running this configuration needs a calibration on the model first: :attr:`needs_heads`,
        or per-layer tensors its method calibrates on the model for these settings
        (:attr:`pace_core.methods.Method.calibration`: DAMP's outlier rows, static scales' ranges)."""
        return self.needs_heads or (method_of(self).calibration(self) is not None and self.calibrated is None)

    @property
    def combined(self) -> tuple[str, ...]:
        """The combinations (:data:`pace_core.methods.COMBINATIONS`) this configuration turns on, e.g.
        ``("rounding",)`` for stochastic rounding; ``()`` for the plain storage (what the Triton kernels cover)."""
        return tuple(name for name in COMBINATIONS if getattr(self, name) != default_of(name))

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
        method = method_of(self)
        _check_choice("reference_dtype", self.reference_dtype, tuple(REFERENCE_DTYPES))
        if self.quantized:
            _check_int("bits", self.bits, QUANT_BITS, f"integers 2..8 for method {self.method!r}")
        elif self.bits != REFERENCE_DTYPES[self.reference_dtype] or not _is_int(self.bits):
            raise PaceError(
                f"bits={self.bits!r} is not allowed for method {self.method!r} with reference_dtype "
                f"{self.reference_dtype!r}; allowed: {REFERENCE_DTYPES[self.reference_dtype]} "
                "(32 with float32, 16 with bfloat16)")
        low = self.bits if self.quantized else 2
        _check_int("high_bits", self.high_bits, range(low, 9), f"integers {low}..8 (at least bits)")
        if not isinstance(self.high_share, float) or not 0.0 <= self.high_share <= 1.0:
            raise PaceError(f"high_share={self.high_share!r} is not allowed; allowed: a number in [0, 1]")
        if self.high_share > 0 and not method.head_widths:
            raise PaceError(f"high_share={self.high_share} is not allowed for method {self.method!r}; "
                            f"allowed: 0 (high-bit heads exist for methods {', '.join(HIGH_SHARE_METHODS)})")
        _check_choice("symmetric", self.symmetric, (True, False))
        if not self.symmetric and method.symmetric_only:
            raise PaceError(f"symmetric=False is not allowed for method {self.method!r}; allowed: True")
        _check_choice("group_axis", self.group_axis, GROUP_AXES)
        if method.grouped and self.group_axis not in method.group_axes:
            raise PaceError(f"group_axis={self.group_axis!r} is not allowed for method {self.method!r}; allowed: "
                            f"{', '.join(map(repr, method.group_axes))} ({method.label} groups along "
                            f"{' or '.join(method.group_axes)})")
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
        self._validate_combinations()
        calibration = method.calibration(self)
        if self.calibrated is not None and (not isinstance(self.calibrated, Calibrated) or calibration is None):
            raise PaceError(f"calibrated is set for method {self.method!r} with these settings; allowed: None"
                            + ("" if calibration is None else " or pace_core.methods.Calibrated"))
        for name, value in self.options:
            setting = METHOD_SETTINGS[name]
            setting.check(value)
            if _OWNER[name] != self.method:
                raise PaceError(f"{name}={value!r} is not allowed for method {self.method!r}; allowed: its default "
                                f"{setting.default!r} ({name} is a setting of method {_OWNER[name]!r})")
        method.check(self)
        return self

    def _validate_combinations(self) -> None:
        _check_choice("rounding", self.rounding, ROUNDINGS)
        _check_int("rounding_seed", self.rounding_seed, range(MAX_ROUNDING_SEED + 1),
                   f"integers 0..{MAX_ROUNDING_SEED}")
        _check_choice("key_hadamard", self.key_hadamard, (True, False))
        _check_choice("scales", self.scales, SCALES)
        low, high = STATIC_MARGINS
        if not isinstance(self.static_margin, float) or not low <= self.static_margin <= high:
            raise PaceError(f"static_margin={self.static_margin!r} is not allowed; allowed: a number in "
                            f"[{low:g}, {high:g}] (a factor on the calibrated ranges)")
        method = method_of(self)
        for name in self.combined:
            if name not in method.composes:
                able = [m for m, spec in _METHODS.items() if name in spec.composes]
                raise PaceError(f"{name}={getattr(self, name)!r} is not allowed for method {self.method!r}; allowed: "
                                f"{default_of(name)!r} (the methods that take {name}={getattr(self, name)!r}: "
                                f"{', '.join(able)})")

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
        outlier rows fit d_k (and d_v is a power of two for its Hadamard transform), d_k is a power of two for
        the key rotation, the calibrated tensors fit the model (the method's ``check_for``), and
        ``high_heads`` has one entry per GDN layer with ``num_high_heads(high_share, HV)`` valid head
        indices. Returns self."""
        if method_of(self).grouped:
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
        if self.key_hadamard and shape.d_k & (shape.d_k - 1):
            raise PaceError(f"key_hadamard=True needs a power-of-two d_k; {shape.name} has d_k={shape.d_k}; "
                            "allowed: key_hadamard=False")
        if self.calibrated is not None and len(self.calibrated.layers) != shape.num_gdn_layers:
            raise PaceError(f"calibrated holds {len(self.calibrated.layers)} layers; allowed: one per GDN layer of "
                            f"{shape.name} ({shape.num_gdn_layers}): calibrate the configuration on this model")
        method_of(self).check_for(self, shape)
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

    def uncalibrated(self) -> PaceConfig:
        """This configuration without what a calibration chose on one model (8-bit heads, per-layer tensors): its
        settings alone, e.g. to count its bits on another model's shape."""
        return self.replace(high_heads=None, calibrated=None) if self.high_heads or self.calibrated else self

    def for_layer(self, gdn_layer: int) -> PaceConfig:
        """This configuration for GDN layer ``gdn_layer`` alone: its share of what is chosen per layer (8-bit
        heads, calibrated tensors)."""
        changes: dict[str, Any] = {}
        if self.high_heads is not None:
            changes["high_heads"] = (self.high_heads[gdn_layer],)
        if self.calibrated is not None:
            changes["calibrated"] = Calibrated([self.calibrated.layers[gdn_layer]])
        return self.replace(**changes) if changes else self

    def replace(self, **changes: Any) -> PaceConfig:
        """A validated copy with `changes` applied, fields and methods' settings alike (unknown names raise
        PaceError)."""
        fields = {f.name for f in dataclasses.fields(self)} - {"options"}
        unknown = sorted(set(changes) - fields - set(METHOD_SETTINGS))
        if unknown:
            allowed = ", ".join(sorted(fields | set(METHOD_SETTINGS)))
            raise PaceError(f"unknown setting(s) {', '.join(unknown)}; allowed: {allowed}")
        options = {**dict(self.options), **{k: v for k, v in changes.items() if k in METHOD_SETTINGS}}
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if k in fields},
                                   options=tuple(options.items()))

    @classmethod
    def make(cls, **values: Any) -> PaceConfig:
        """A configuration of fields and methods' settings alike (``PaceConfig(...)`` takes fields only)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in fields},
                   options=tuple((k, v) for k, v in values.items() if k not in fields))

    def quant_spec(self, bits: int | None = None) -> QuantSpec:
        """The group quantiser of this config at `bits` (default: the low bits ``self.bits``)."""
        if not method_of(self).grouped:
            grouped = ", ".join(name for name, m in _METHODS.items() if m.grouped)
            raise PaceError(f"method {self.method!r} has no group quantiser; allowed: {grouped}")
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


def _share(x: float) -> str:
    return f"{x:.0%}" if x in (0.0, 1.0) else f"{x:.1%}".replace(".0%", "%")


def _per_vector(g: int) -> str:
    return "per vector" if g == 0 else str(g)


SETTINGS: tuple[Setting, ...] = (
    Setting("name"),
    Setting("method", url="method", label="Method", options=METHODS,
            help="How the recurrent state is stored between roundings. " + "; ".join(
                f"**{name}**: {m.description}" for name, m in _METHODS.items())),
    Setting("reference_dtype", schema=1, url="ref", label="Reference dtype (method none)",
            help="Storage dtype of the checkpoint when quantisation is off: the 'rounding' at each period end is the "
                 "cast to this dtype (identity for float32).", options=tuple(REFERENCE_DTYPES)),
    Setting("bits", json="num_bits", section="state_cache_scheme", url="bits", label="State bits (bits/value)",
            help="Bit width b of the integer codes of the low-precision heads (spec §2). Symmetric codes lie in "
                 "[−(2^(b−1)−1), 2^(b−1)−1]; zero-point codes in [0, 2^b−1]. Every width is stored densely: b bits "
                 "a code (3 bits: 8 codes in 3 bytes), a row padded only to a whole byte. The line under this "
                 "control gives each width's resident bits and state bytes per sequence with the other settings.",
            options=QUANT_BITS, cli="--bits", cli_help="state bits of the low-precision heads (2..8)"),
    Setting("decode_period", url="dp", label="Decode period dP (tokens)", symbol="dP", options=tuple(range(1, 65)),
            help="The state is rounded once every dP generated tokens (spec §3). In between, the rounded checkpoint "
                 "Ŝ stays fixed and each token's (k_t, u_t, g_t) goes into the decode buffer [ours: u_t instead of v_t "
                 "makes the buffered path exact]. dP = 1 is per-token rounding.",
            cli="--dp", cli_help="decode period dP (1 = per-token rounding)"),
    Setting("prefill_period", url="pp", label="Prefill period P (tokens)", symbol="P",
            options=(16, 32, 64, 128, 256, 512, 1024, 2048),
            help="The prompt is split into P-token segments; each segment runs from the dequantised state and its "
                 "final state is rounded (spec §3; the paper fixes P = 256, the kernel chunk).",
            cli="--prefill-period", cli_help="prefill period P"),
    Setting("group_axis", url="axis", label="Group axis", options=GROUP_AXES,
            help="**key** (from the paper): a group is g consecutive key rows of one value column S[k0:k0+g, j], so "
                 "an outlier column widens only its own step. **value** (baseline): S[i, j0:j0+g].",
            cli="--axis", cli_help="group axis"),
    Setting("group_size", section="state_cache_scheme", url="g", label="Group size g (values)", symbol="g",
            options=(8, 16, 32, 64, 128),
            help="Entries sharing one fp16 scale (and zero point). Must divide the head dimension along the group "
                 "axis (128 on Qwen3.5).", cli="--group-size", cli_help="scale group size g"),
    Setting("symmetric", section="state_cache_scheme", url="sym", label="Symmetric (no zero point)",
            options=(True, False),
            help="On: scale = amax / qmax, no zero point. Off: scale = (max − min)/(2^b − 1) with an integer zero "
                 "point stored in b bits (PACE-4/8 uses a zero point).",
            cli="--symmetric", cli_help="symmetric codes (--no-symmetric: integer zero point)"),
    Setting("scale_dtype", section="state_cache_scheme"),
    Setting("buffer", json="buffer_precision", url="buf", label="Decode buffer precision", options=BUFFER_PRECISIONS,
            help="Precision of the buffered (k_t, u_t) records between roundings: int8 (PACE-4, uniform configs), "
                 "mixed = keys 4-bit + values bf16 (PACE-4/8), bf16/fp32 as references (from the paper). Integer "
                 "parts have fp16 scales per group of each vector (the buffer group settings below; our choice).",
            cli="--buffer", cli_help="decode-buffer precision"),
    Setting("buffer_key_group", schema=3, before=0, url="bkg", label="Buffer key group (entries per scale)",
            options=(0, 16, 32, 64, 128), fmt=_per_vector,
            help="Our choice. Integer buffer keys (int8; mixed: 4-bit): entries of one buffered key vector that share "
                 "one fp16 scale (and zero point). 'per vector' = one scale per key vector. Smaller groups cost 16/g "
                 "bits per entry in the buffer term c · dP and follow outlier channels closer."),
    Setting("buffer_key_symmetric", schema=3, before=True, url="bks", label="Buffer keys symmetric",
            options=(True, False),
            help="Off (our choice): each buffered key group gets an integer zero point (its bits per group count in "
                 "c)."),
    Setting("buffer_value_group", schema=3, before=0, url="bvg", label="Buffer value group (entries per scale)",
            options=(0, 16, 32, 64, 128), fmt=_per_vector,
            help="Our choice. Integer buffer values u_t (int8 only; mixed and float buffers keep values in "
                 "bf16/fp32): entries per fp16 scale along each buffered value vector. 'per vector' = one scale per "
                 "vector."),
    Setting("buffer_value_symmetric", schema=3, before=True, url="bvs", label="Buffer values symmetric",
            options=(True, False), help="Off (our choice): each buffered value group gets an integer zero point."),
    Setting("exact_current_token", schema=3, before=False, url="cur", label="Exact current token",
            options=(True, False),
            help="On (our choice): a token's own output and its delta value use its exact k_t, u_t, which are at hand "
                 "when it is processed; only the record stored for the later tokens is rounded (no memory cost). Off: "
                 "the token reads back its own rounded record."),
    Setting("prefill_after_decode", schema=2, before="flush", url="pad", label="Prompt after decoded tokens",
            options=PREFILL_AFTER_DECODE,
            help="Our choice (the spec is silent): How a prompt that follows decoded tokens starts, e.g. a user's "
                 "next turn: **flush** folds the buffered records into the checkpoint and rounds it first (one extra "
                 "rounding, off the dP grid); **carry** runs the prompt from the exact state (checkpoint plus buffer, "
                 "not rounded), so its first rounding ends its first P-token segment. It is part of the exported "
                 "configuration; this app's views run one prompt and then decode, so they do not change with it."),
    Setting("rounding", schema=6, before="nearest", url="rnd", label="Rounding of the state codes",
            options=ROUNDINGS, read_if=lambda cfg: cfg.rounding != "nearest",
            help="Not tested by the PACE paper. **nearest**: codes round half to even. **stochastic**: codes are "
                 "floor(x/s + u) with u uniform in [0, 1), unbiased on average; one generator per layer state, seeded "
                 "from the seed and the GDN layer, advanced by each rounding (the same settings, seed and inputs give "
                 "the same codes). The decode buffer's records keep round to nearest. RTN, PACE, DSQ and DAMP."),
    Setting("rounding_seed", schema=6, before=0, url="seed", label="Stochastic rounding seed",
            options=tuple(range(8)), read_if=lambda cfg: cfg.rounding != "nearest",
            help="The seed of stochastic rounding (0..65535): layer i's generator starts from seed · 65536 + i."),
    Setting("key_hadamard", schema=6, before=False, url="kh", label="Hadamard rotation along the key axis",
            options=(True, False), read_if=lambda cfg: cfg.key_hadamard,
            help="Not tested by the PACE paper: store Q(H S), H the orthonormal Hadamard matrix of size d_k applied "
                 "to each head's key axis, and load Hᵀ Q(H S): an outlier key row is spread over all rows before "
                 "grouping. Same bytes; d_k must be a power of two. RTN, PACE and DSQ."),
    Setting("scales", schema=6, before="dynamic", url="sc", label="Scales", options=SCALES,
            read_if=lambda cfg: cfg.scales != "dynamic",
            help="Not tested by the PACE paper. **dynamic**: each checkpoint's groups get their own fp16 scales. "
                 "**static**: each group's range is calibrated once per layer on calibration text and kept once per "
                 "layer, so a sequence stores its codes alone (no scale bits per sequence); values beyond the "
                 "calibrated range (times the margin) saturate. RTN and PACE.",
            cli="--scales", cli_help="dynamic (per checkpoint) or static (calibrated per layer) scales"),
    Setting("static_margin", schema=6, before=STATIC_MARGIN, url="mg", label="Static scales' margin",
            options=(0.5, 0.625, 0.75, 1.0, 1.25), fmt=lambda m: f"{m:g}×", read_if=lambda cfg: cfg.scales != "dynamic",
            help="Our choice: the factor on the calibrated ranges the static scales are taken from. Below 1 it clips "
                 "the calibration's rare extremes: a smaller margin rounds finer and saturates more. 0.625 by default, "
                 "measured best on held-out text (KL 6.6e-4 on the embedded model; 1.0: 1.3e-3)."),
    Setting("high_share", url="hi", label="Share of 8-bit heads", options=(0.0, 0.125, 0.25, 0.375, 0.5, 0.75, 1.0),
            fmt=_share, read_if=lambda cfg: cfg.high_share > 0,
            help="PACE-4/8 (spec §4): in each layer this share of value heads, those with the largest retained error "
                 "E_h = e_h / (1 − a_h^(2·dP)), keep high_bits (8). Our choice: a_h = mean decay on calibration "
                 "text, e_h = mean rounding error energy of calibration states.",
            cli="--high-share", cli_help="share of heads per layer at --high-bits (0..1)"),
    Setting("high_bits", cli="--high-bits", cli_help="bits of the promoted heads",
            read_if=lambda cfg: cfg.high_share > 0),
    Setting("high_heads", read_if=lambda cfg: cfg.high_share > 0),
    Setting("damp_outlier_rows", cli="--outlier-rows", cli_help="DAMP outlier key rows in fp16"),
    Setting("damp_hadamard"),
    Setting("calibrated", schema=5, before=None, read_if=lambda cfg: method_of(cfg).calibration(cfg) is not None),
    *(st for method in _METHODS.values() for st in method.settings),
)
"""Every setting's :class:`~pace_core.settings.Setting`: PaceConfig's fields, then each method's own settings
(held in ``options``); the app's controls in this order."""
SETTING_OF: dict[str, Setting] = {s.field: s for s in SETTINGS}
METHOD_SETTINGS: dict[str, Setting] = {st.field: st for method in _METHODS.values() for st in method.settings}
"""The methods' own settings by name (:attr:`pace_core.methods.Method.settings`)."""


_OWNER: dict[str, str] = {st.field: method.name for method in _METHODS.values() for st in method.settings}


def _options(options: Any) -> tuple[tuple[str, Any], ...]:
    """Methods' settings as ``options`` holds them: known names, sorted, defaults left out (so equal
    configurations compare equal)."""
    if not isinstance(options, tuple) or not all(isinstance(o, tuple) and len(o) == 2 for o in options):
        raise PaceError(f"options={options!r} is not allowed; allowed: (name, value) pairs of methods' settings")
    unknown = [name for name, _ in options if name not in METHOD_SETTINGS]
    if unknown:
        raise PaceError(f"option {unknown[0]!r} is unknown; allowed: {', '.join(METHOD_SETTINGS) or 'none'}")
    return tuple(sorted((k, v) for k, v in dict(options).items() if v != METHOD_SETTINGS[k].default
                        or type(v) is not type(METHOD_SETTINGS[k].default)))


def default_of(field: str) -> Any:
    """The default value of a setting (a PaceConfig field's, or a method setting's)."""
    if field in METHOD_SETTINGS:
        return METHOD_SETTINGS[field].default
    return PaceConfig.__dataclass_fields__[field].default


NAMED_CONFIGS: dict[str, PaceConfig] = {
    name: PaceConfig.make(name=name, method=method.name, **values)
    for method in _METHODS.values() for name, values in method.named.items()}
"""The named configurations of PACE_SPEC §6, each declared by its method (:mod:`pace_core.methods`); starting
points: every field can be changed."""


def get_config(name: str) -> PaceConfig:
    """The named configuration `name` (case-insensitive); unknown names raise PaceError listing them."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in NAMED_CONFIGS:
        raise PaceError(f"config {name!r} is unknown; allowed: {', '.join(NAMED_CONFIGS)}")
    return NAMED_CONFIGS[key]


def _json_value(cfg: PaceConfig, field: str) -> Any:
    """A field's value in the record (the high-bit heads keyed by GDN-layer ordinal)."""
    value = getattr(cfg, field)
    if field == "high_heads" and value is not None:
        return {str(i): list(layer) for i, layer in enumerate(value)}
    if field == "calibrated" and value is not None:
        return value.to_json()
    return value


def _strategy(method: str) -> str | None:
    return method_of(method).strategy


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
        "pace": {st.json: _json_value(cfg, st.field) for st in SETTINGS if st.section == "pace"},
        "provenance": dict(provenance or {}),
    }


_SCHEME_KEYS = ("num_bits", "type", "symmetric", "strategy", "group_size", "scale_dtype", "zp_dtype")
_PACE_KEYS_BY_SCHEMA = {v: tuple(st.json for st in SETTINGS if st.section == "pace" and st.schema <= v)
                        for v in range(1, SCHEMA_VERSION + 1)}
"""The ``pace`` keys of each record schema (:attr:`Setting.schema`)."""
_OLDER_SCHEMA_VALUES = {st.json: st.before for st in SETTINGS if st.schema > 1}
"""What documents of an older schema were made with (:attr:`Setting.before`)."""
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
    """A configuration document: a complete record made by :func:`config_to_dict` (schema 1..3, 5) or a
    deployable export (schema 4, 5 with ``kind``, :mod:`pace_core.export`).

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
    if version == 4 or (version >= 5 and "kind" in d):
        from pace_core.export import document_from_export

        return document_from_export(d)
    if version > SCHEMA_VERSION:
        raise PaceError(f"config JSON field schema_version={version} without a kind is newer than this PACE Studio's "
                        f"complete record (schema {SCHEMA_VERSION}); allowed: 1..{SCHEMA_VERSION}, or an export "
                        f"(kind 'pace-state-config') up to {newest}")
    missing = [k for k in _TOP_KEYS if k not in d]
    if missing:
        raise PaceError(f"config JSON field {missing[0]} is missing; required: {', '.join(_TOP_KEYS)}")
    for key in ("producer", "provenance"):
        if not isinstance(d[key], dict):
            raise PaceError(f"config JSON field {key} must be an object; got {type(d[key]).__name__}")
    if d["model"] is not None and not isinstance(d["model"], str):
        raise PaceError(f"config JSON field model={d['model']!r} is not allowed; allowed: a string or null")
    pace = {**_OLDER_SCHEMA_VALUES, **_section(d, "pace", _PACE_KEYS_BY_SCHEMA[version])}
    if pace["calibrated"] is not None:
        pace["calibrated"] = Calibrated.from_json(pace["calibrated"], "pace.calibrated")
    cfg = config_from_sections(d["state_cache_scheme"], pace, high_heads=_high_heads_from_json(pace["high_heads"]))
    return ConfigDocument(cfg, d["model"], d["producer"], d["provenance"])


def config_from_sections(scheme: Any, pace: dict, *, high_heads: tuple[tuple[int, ...], ...] | None) -> PaceConfig:
    """The PaceConfig of a ``state_cache_scheme`` object (its keys checked here) and a complete ``pace``
    object (every key of the current schema; ``high_heads`` already decoded), checked against each other."""
    scheme = _section({"state_cache_scheme": scheme}, "state_cache_scheme", _SCHEME_KEYS)
    _check_choice("config JSON field state_cache_scheme.type", scheme["type"], ("int", "float"))
    try:
        quantized = method_of(pace["method"]).quantized
    except PaceError as e:
        raise PaceError(f"config JSON field pace.{e}") from None
    if (scheme["type"] == "float") == quantized:
        raise PaceError(f"config JSON field state_cache_scheme.type={scheme['type']!r} does not match "
                        f"pace.method={pace['method']!r}; allowed: 'float' for the references (method none), "
                        "'int' otherwise")
    try:
        cfg = PaceConfig.make(**{st.field: (high_heads if st.field == "high_heads" else
                                            (scheme if st.section == "state_cache_scheme" else pace)[st.json])
                                 for st in SETTINGS})
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
