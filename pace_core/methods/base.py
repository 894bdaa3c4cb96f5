"""What a state quantiser is to the studio: :class:`Method`, one instance per module of
:mod:`pace_core.methods`, declaring everything the rest of the code asks of a method (its settings, its
capabilities, how it stores a checkpoint and what that costs), and the registry of them.

A configuration names its method (``PaceConfig.method``); every other module asks :func:`method_of` instead
of comparing method names, so adding a method is adding one module.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import torch

from pace_core.checkpoint import StateFormat
from pace_core.errors import PaceError
from pace_core.settings import Configuration, Setting

if TYPE_CHECKING:
    from pace_core.shapes import ModelShape


@dataclass(frozen=True)
class Sampling:
    """The calibration samples a method takes instead of the shared ones (:attr:`Method.sampling`;
    :func:`pace_core.analysis.calibration.protocol_samples` takes them): ``segments`` windows of ``tokens`` tokens at
    offsets of the calibration text drawn by a ``torch.Generator`` seeded ``seed`` (each window read from a zero
    state); after every ``every``-th token of a window each GDN layer's state is offered to that layer's reservoir of
    ``reservoir`` states (the k-th state offered, k > ``reservoir``, replaces slot ``i = randint(k)`` when
    ``i < reservoir``; one generator seeded ``seed`` per layer); each window's recorded inputs of a layer are
    reduced by ``reduce`` (``{"q", "k": [T, H, K], "g", "beta": [T, HV]} -> {name: float64 sum over the window's
    tokens}``), added up over the windows. ``name`` is how the samples are named to the user."""

    name: str
    segments: int
    tokens: int
    every: int
    reservoir: int
    seed: int
    reduce: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]

    @property
    def total_tokens(self) -> int:
        """The tokens read: ``segments · tokens``."""
        return self.segments * self.tokens

    def describe(self) -> str:
        """The samples in words: '32 segments of 2,048 tokens at random offsets (seed 0), a state every 8 tokens into
        a reservoir of 64 per layer'."""
        return (f"{self.segments} segments of {self.tokens:,} tokens at random offsets (seed {self.seed}), a state "
                f"every {self.every} tokens into a reservoir of {self.reservoir} per layer")


@dataclass(frozen=True)
class LayerCalibration:
    """What a method calibrates per GDN layer on one model (DAMP's outlier rows): tensor name -> what it holds
    (its dtype and shape are the format's to check)."""

    tensors: dict[str, str]


_DTYPES = {str(t).removeprefix("torch."): t for t in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
                                                      torch.float16, torch.bfloat16, torch.float32)}


class Calibrated:
    """A method's tensors calibrated on one model: one ``{name: tensor}`` per GDN layer, on the CPU, read-only,
    in the dtypes the method stores them in (the bytes the accounting counts). Equal and hashed by
    :attr:`digest`, the sha256 of the tensors' names, dtypes, shapes and bytes."""

    def __init__(self, layers: Sequence[dict[str, torch.Tensor]]) -> None:
        if not layers or not all(isinstance(d, dict) and d for d in layers):
            raise PaceError("calibrated: one non-empty {name: tensor} per GDN layer is required")
        h = hashlib.sha256()
        self.layers: tuple[dict[str, torch.Tensor], ...] = tuple(
            {k: t.detach().to("cpu").contiguous() for k, t in sorted(d.items())} for d in layers)
        for d in self.layers:
            for name, t in d.items():
                if not isinstance(t, torch.Tensor) or t.dtype not in _DTYPES.values():
                    raise PaceError(f"calibrated[{name!r}]: {type(t).__name__} not allowed; allowed: a tensor of "
                                    f"{', '.join(_DTYPES)}")
                h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
                h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        self.digest = h.hexdigest()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Calibrated) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return f"Calibrated({len(self.layers)} layers, {self.digest[:12]})"

    def to_json(self) -> list[dict[str, dict[str, Any]]]:
        """Plain JSON: per GDN layer ``{name: {"dtype", "shape", "data": base64 of the little-endian bytes}}``."""
        return [{name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                        "data": base64.b64encode(t.view(torch.uint8).numpy().tobytes()).decode("ascii")}
                 for name, t in d.items()} for d in self.layers]

    @classmethod
    def from_json(cls, value: Any, where: str = "calibrated") -> Calibrated:
        """The inverse of :meth:`to_json`; PaceError naming ``where`` for anything else."""
        allowed = (f'allowed: a list with one object per GDN layer of {{"<name>": {{"dtype": one of '
                   f'{", ".join(_DTYPES)}, "shape": [...], "data": "<base64>"}}}}')
        if not isinstance(value, list) or not value:
            raise PaceError(f"the field {where} is not allowed; {allowed}")
        layers = []
        for i, d in enumerate(value):
            if not isinstance(d, dict) or not d:
                raise PaceError(f"the field {where}[{i}] is not allowed; {allowed}")
            layer = {}
            for name, entry in d.items():
                try:
                    dtype, shape = _DTYPES[entry["dtype"]], tuple(int(n) for n in entry["shape"])
                    raw = bytearray(base64.b64decode(entry["data"], validate=True))
                    layer[name] = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape) if raw else (
                        torch.empty(shape, dtype=dtype))
                except (KeyError, TypeError, ValueError, RuntimeError, binascii.Error) as e:
                    raise PaceError(f"the field {where}[{i}].{name} is not allowed ({type(e).__name__}: {e}); "
                                    f"{allowed}") from None
            layers.append(layer)
        return cls(layers)


COMBINATIONS: dict[str, tuple[str, ...]] = {
    "rounding": ("rounding", "rounding_seed"),
    "key_hadamard": ("key_hadamard",),
    "scales": ("scales", "static_margin", "calibrated"),
}
"""The settings that combine with a method's storage, as the PACE paper lists them untested (stochastic rounding,
a Hadamard rotation of the state along the key axis, static scales), each with the settings read with it
(:class:`pace_core.config.PaceConfig`'s fields; off at their defaults). A method takes those in its ``composes``."""

@dataclass(frozen=True)
class Method:
    """One state quantiser.

    - ``name`` (``PaceConfig.method``), ``order`` (where the app and the named configurations list it),
      ``label``, ``description`` (the app's help);
    - ``quantized``: False for the full-precision references;
    - ``reads``: the PaceConfig settings it reads beyond those every configuration has (bits, the periods,
      the buffer's): what an export writes and the app enables;
    - ``group_axes``: the axes its scale groups may run along (``()``: no groups), ``symmetric_only``,
      ``head_widths``: a share of heads may be kept at ``high_bits``; ``strategy``: compressed-tensors'
      ``QuantizationArgs.strategy`` of its scales;
    - ``calibration``: ``(cfg) -> LayerCalibration | None``, the per-layer tensors ``cfg`` needs calibrated on the
      model (None: none; RTN and PACE need them only with static scales);
    - ``composes``: the combinations of :data:`COMBINATIONS` it takes (its ``reads`` then include their settings);
      a configuration of another method keeps them at their defaults;
    - ``kernels``: the Triton kernels store and step it; ``pool``: a serving engine's pool row holds it;
    - ``named``: its named configurations, as PaceConfig field values; ``tags``: each named configuration's tags
      (:data:`pace_core.config.named.TAGS`: the lists of configurations the study, the CLI, the app and the serving
      checks take are those of a tag);
    - ``format``: ``(cfg, bits_per_head, layer tensors or None, name, gdn_index) -> StateFormat``, how a layer's
      checkpoint is stored (:mod:`pace_core.checkpoint`);
    - ``payload``: ``(cfg, shape) -> (code bits, scale bits)`` per state value, the accounting's payload
      (:mod:`pace_core.accounting`), and ``layer_bytes``: ``(cfg, shape, sequences, GDN layer) -> bytes`` of
      one layer's stored checkpoints, ``fixed_bytes``: ``(cfg, shape, GDN layer) -> bytes`` kept once per
      layer (head maps, row indices);
    - ``settings``: its own settings beyond PaceConfig's fields (:class:`pace_core.settings.Setting`, with their
      defaults), which configurations hold in ``options`` and every other module reads like fields;
    - ``check``: ``(cfg) -> None``, ``check_for``: ``(cfg, shape) -> None``, the method's own validation
      (PaceError naming the field);
    - ``groups_along``: ``(cfg) -> str | None``, the axis its groups run along (the export's state layout);
    - ``calibrate``: ``(cfg, samples, layers) -> per-layer tensors`` on :class:`pace_core.analysis.calibration`
      samples, when ``calibration`` is set; ``sampling``: ``(cfg) -> Sampling | None``, the samples it takes instead
      of the shared ones (None: the shared ones).
    """

    name: str
    order: int
    label: str
    description: str
    format: Callable[..., StateFormat]
    payload: Callable[[Configuration, ModelShape], tuple[Fraction, Fraction]]
    layer_bytes: Callable[[Configuration, ModelShape, int, int], int]
    quantized: bool = True
    reads: tuple[str, ...] = ()
    group_axes: tuple[str, ...] = ()
    symmetric_only: bool = False
    head_widths: bool = False
    strategy: str | None = "group"
    calibration: Callable[[Configuration], LayerCalibration | None] = lambda cfg: None
    composes: tuple[str, ...] = ()
    kernels: bool = False
    pool: bool = False
    named: dict[str, dict[str, Any]] = field(default_factory=dict)
    tags: dict[str, tuple[str, ...]] = field(default_factory=dict)
    settings: tuple[Setting, ...] = ()
    fixed_bytes: Callable[[Configuration, ModelShape, int], int] = lambda cfg, shape, layer: 0
    check: Callable[[Configuration], None] = lambda cfg: None
    check_for: Callable[[Configuration, ModelShape], None] = lambda cfg, shape: None
    groups_along: Callable[[Configuration], str | None] = lambda cfg: None
    calibrate: Callable[..., list[dict[str, torch.Tensor]]] | None = None
    sampling: Callable[[Configuration], Sampling | None] = lambda cfg: None

    def __post_init__(self) -> None:
        unknown = [c for c in self.composes if c not in COMBINATIONS]
        if unknown:
            raise PaceError(
                f"method {self.name!r}: composes={unknown!r} is not allowed; allowed: {', '.join(COMBINATIONS)}"
            )
        untagged = [name for name in self.tags if name not in self.named]
        if untagged:
            raise PaceError(f"method {self.name!r}: tags for {untagged!r}, which it does not name; allowed: "
                            f"{', '.join(self.named)}")
        extra = [f for c in self.composes for f in COMBINATIONS[c] if f not in self.reads]
        object.__setattr__(self, "reads", (*self.reads, *dict.fromkeys(extra)))

    @property
    def grouped(self) -> bool:
        """Whether its scales come in groups of ``group_size`` along an axis."""
        return bool(self.group_axes)


METHODS: dict[str, Method] = {}
"""The registered methods by name, in the order the app lists them."""


def register(method: Method) -> Method:
    """Add ``method`` to :data:`METHODS` (its module calls this once)."""
    if method.name in METHODS:
        raise PaceError(f"method {method.name!r} is registered twice")
    METHODS[method.name] = method
    return method


def state_format(cfg: Configuration, bits_per_head: tuple[int, ...], layer: dict[str, torch.Tensor] | None = None,
                 name: str = "state", gdn_index: int = 0) -> StateFormat:
    """The :class:`~pace_core.checkpoint.StateFormat` of ``cfg``'s method for GDN layer ``gdn_index``
    (:attr:`Method.format`)."""
    return method_of(cfg).format(cfg, bits_per_head, layer, name, gdn_index)


def method_of(name_or_cfg: Any) -> Method:
    """The :class:`Method` of a method name or of a configuration (PaceError naming the known ones)."""
    name = getattr(name_or_cfg, "method", name_or_cfg)
    found = METHODS.get(name) if isinstance(name, str) else None
    if found is None:
        raise PaceError(f"method={name!r} is not allowed; allowed: {', '.join(map(repr, METHODS))}")
    return found
