"""A configuration setting's metadata (:class:`Setting`): the one place that names a PaceConfig setting
everywhere it appears. The core settings are listed in :data:`pace_core.config.SETTINGS`; a method module adds
its own (:attr:`pace_core.methods.Method.settings`), which :class:`~pace_core.config.PaceConfig` holds in its
``options`` and reads like its fields. :class:`Configuration` is a configuration as the layers below
:mod:`pace_core.config` see it (checkpoint formats, methods, head allocation), which PaceConfig implements."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pace_core.errors import PaceError


class Configuration(Protocol):
    """What the layers below :mod:`pace_core.config` read of a configuration
    (:class:`pace_core.config.PaceConfig`, which imports them): its settings by name (fields and methods' own
    settings alike), the exact-storage flag and the group quantiser."""

    name: str
    method: str
    bits: int
    high_bits: int
    high_share: float
    high_heads: tuple[tuple[int, ...], ...] | None
    symmetric: bool
    group_axis: str
    group_size: int
    decode_period: int
    calibrated: Any

    @property
    def exact(self) -> bool: ...

    def quant_spec(self, bits: int | None = None) -> Any: ...

    def __getattr__(self, name: str) -> Any: ...


@dataclass(frozen=True)
class Setting:
    """One setting's metadata: its key (``json``) in the record's ``section`` (``state_cache_scheme`` or
    ``pace``; an export writes the same keys), the record schema that added it and the value documents of older
    schemas were made with; the app's control (its URL key ``url``, also taking the field's name and the
    ``symbol`` of its label, its label, help, choices and how a choice is shown; no ``url``: no control); the
    CLI's flag of the configuration overrides; ``read_if``: where a method reads it only under some settings (the
    8-bit heads' with a share of them, a combination's when it is on), that condition, else None (always, for the
    methods whose ``reads`` name it): an export writes the setting where it holds. A method's own setting also has
    its ``default`` and ``allowed`` (its values: a range or a tuple, checked when a configuration is made, with
    ``allowed_text`` in the message)."""

    field: str
    json: str = ""
    section: str = "pace"
    schema: int = 1
    before: Any = None
    url: str | None = None
    label: str = ""
    help: str = ""
    options: tuple[Any, ...] = ()
    fmt: Callable[[Any], str] = str
    symbol: str | None = None
    cli: str | None = None
    cli_help: str = ""
    default: Any = None
    allowed: Any = None
    allowed_text: str = ""
    read_if: Callable[[Any], bool] | None = None

    def __post_init__(self) -> None:
        if not self.json:
            object.__setattr__(self, "json", self.field)

    def check(self, value: Any) -> None:
        """PaceError naming the setting and its allowed values unless ``value`` is allowed (a method's setting)."""
        ok = (isinstance(value, type(self.default)) and not (isinstance(value, bool) != isinstance(self.default, bool))
              and value in self.allowed)
        if not ok:
            raise PaceError(f"{self.field}={value!r} is not allowed; allowed: {self.allowed_text or self.allowed}")
