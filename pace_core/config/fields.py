"""A configuration's fields and their validation: :class:`PaceConfig`, one frozen dataclass of every setting
(PACE_SPEC §2-§6), valid from construction on (``__post_init__`` validates; bad input raises
:class:`~pace_core.errors.PaceError` naming the field and its allowed values). What depends on a model (a group
size dividing the real axis, the per-layer 8-bit heads) is checked by :meth:`PaceConfig.validate_for`, once, where
a configuration meets a model (:func:`pace_core.export.admit`, :class:`pace_core.state_store.StateStore`).

A method's own settings (:attr:`pace_core.methods.Method.settings`) are held in ``options`` and read like fields.
The settings' metadata is :mod:`pace_core.config.table`; the named configurations :mod:`pace_core.config.named`;
the JSON forms (the complete record and the deployable export) :mod:`pace_core.export`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pace_core.buffer import BufferFormat
from pace_core.errors import PaceError
from pace_core.heads import num_high_heads
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
"""Seeds 0..65535: a layer's generator is seeded with ``seed · 2^16 + GDN layer`` (torch's CPU generator keeps 32
bits)."""
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
HIGH_SHARE_METHODS: tuple[str, ...] = tuple(name for name, m in _METHODS.items() if m.head_widths)
"""Methods whose heads may be split into low- and high-bit heads."""


def is_int(x: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


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
      calibrated once per layer) with ``static_margin`` (the calibrated ranges' factor, 0.25..16: below 1 it clips
      them).
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
            if is_int(getattr(self, name)):
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
        check_choice("method", self.method, METHODS)
        method = method_of(self)
        check_choice("reference_dtype", self.reference_dtype, tuple(REFERENCE_DTYPES))
        if self.quantized:
            check_int("bits", self.bits, QUANT_BITS, f"integers 2..8 for method {self.method!r}")
        elif self.bits != REFERENCE_DTYPES[self.reference_dtype] or not is_int(self.bits):
            raise PaceError(
                f"bits={self.bits!r} is not allowed for method {self.method!r} with reference_dtype "
                f"{self.reference_dtype!r}; allowed: {REFERENCE_DTYPES[self.reference_dtype]} "
                "(32 with float32, 16 with bfloat16)")
        low = self.bits if self.quantized else 2
        check_int("high_bits", self.high_bits, range(low, 9), f"integers {low}..8 (at least bits)")
        if not isinstance(self.high_share, float) or not 0.0 <= self.high_share <= 1.0:
            raise PaceError(f"high_share={self.high_share!r} is not allowed; allowed: a number in [0, 1]")
        if self.high_share > 0 and not method.head_widths:
            raise PaceError(f"high_share={self.high_share} is not allowed for method {self.method!r}; "
                            f"allowed: 0 (high-bit heads exist for methods {', '.join(HIGH_SHARE_METHODS)})")
        check_choice("symmetric", self.symmetric, (True, False))
        if not self.symmetric and method.symmetric_only:
            raise PaceError(f"symmetric=False is not allowed for method {self.method!r}; allowed: True")
        check_choice("group_axis", self.group_axis, GROUP_AXES)
        if method.grouped and self.group_axis not in method.group_axes:
            raise PaceError(f"group_axis={self.group_axis!r} is not allowed for method {self.method!r}; allowed: "
                            f"{', '.join(map(repr, method.group_axes))} ({method.label} groups along "
                            f"{' or '.join(method.group_axes)})")
        check_int("group_size", self.group_size, GROUP_SIZES_NO_SHAPE,
                   "powers of two dividing 128: " + ", ".join(map(str, GROUP_SIZES_NO_SHAPE)))
        check_choice("scale_dtype", self.scale_dtype, SCALE_DTYPES)
        check_int("decode_period", self.decode_period, range(1, MAX_DECODE_PERIOD + 1),
                   f"integers 1..{MAX_DECODE_PERIOD}")
        check_int("prefill_period", self.prefill_period, range(1, MAX_PREFILL_PERIOD + 1),
                   f"integers 1..{MAX_PREFILL_PERIOD}")
        check_choice("buffer", self.buffer, BUFFER_PRECISIONS)
        check_choice("prefill_after_decode", self.prefill_after_decode, PREFILL_AFTER_DECODE)
        check_choice("exact_current_token", self.exact_current_token, (True, False))
        for part in ("key", "value"):
            check_int(f"buffer_{part}_group", getattr(self, f"buffer_{part}_group"), (0, *GROUP_SIZES_NO_SHAPE),
                       "0 (one group per vector) or a power of two dividing 128: "
                       + ", ".join(map(str, GROUP_SIZES_NO_SHAPE)))
            check_choice(f"buffer_{part}_symmetric", getattr(self, f"buffer_{part}_symmetric"), (True, False))
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
        check_choice("rounding", self.rounding, ROUNDINGS)
        check_int("rounding_seed", self.rounding_seed, range(MAX_ROUNDING_SEED + 1),
                   f"integers 0..{MAX_ROUNDING_SEED}")
        check_choice("key_hadamard", self.key_hadamard, (True, False))
        check_choice("scales", self.scales, SCALES)
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
            if (not isinstance(layer, tuple) or not all(is_int(h) and h >= 0 for h in layer)
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


def check_choice(field: str, value: Any, allowed: tuple) -> None:
    ok = any(value is a if isinstance(a, bool) else (type(value) is type(a) and value == a) for a in allowed)
    if not ok:
        raise PaceError(f"{field}={value!r} is not allowed; allowed: {', '.join(map(repr, allowed))}")


def check_int(field: str, value: Any, allowed: range | tuple, text: str) -> None:
    if not is_int(value) or value not in allowed:
        raise PaceError(f"{field}={value!r} is not allowed; allowed: {text}")


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


