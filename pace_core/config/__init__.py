"""A configuration, and only that: its fields and their validation (:mod:`pace_core.config.fields`,
:class:`PaceConfig`), the settings table (:mod:`pace_core.config.table`, :data:`SETTINGS`) and the named
configurations (:mod:`pace_core.config.named`). Its JSON forms are :mod:`pace_core.export`'s."""

from pace_core.config.fields import (
    BUFFER_PRECISIONS,
    GROUP_SIZES_NO_SHAPE,
    HIGH_SHARE_METHODS,
    MAX_DECODE_PERIOD,
    MAX_PREFILL_PERIOD,
    MAX_ROUNDING_SEED,
    METHOD_SETTINGS,
    METHODS,
    PREFILL_AFTER_DECODE,
    QUANT_BITS,
    REFERENCE_DTYPES,
    ROUNDINGS,
    SCALE_DTYPES,
    SCALES,
    STATIC_MARGINS,
    BufferPrecision,
    PaceConfig,
    PrefillAfterDecode,
    Rounding,
    Scales,
    check_choice,
    check_int,
    default_of,
    is_int,
)
from pace_core.config.named import NAMED_CONFIGS, TAGGED, TAGS, get_config, tagged
from pace_core.config.table import SETTING_OF, SETTINGS

__all__ = [
    "BUFFER_PRECISIONS", "GROUP_SIZES_NO_SHAPE", "HIGH_SHARE_METHODS", "MAX_DECODE_PERIOD",
    "MAX_PREFILL_PERIOD", "MAX_ROUNDING_SEED", "METHODS", "METHOD_SETTINGS", "NAMED_CONFIGS", "PREFILL_AFTER_DECODE",
    "QUANT_BITS", "REFERENCE_DTYPES", "ROUNDINGS", "SCALES", "SCALE_DTYPES", "SETTINGS", "SETTING_OF",
    "STATIC_MARGINS", "TAGGED", "TAGS", "BufferPrecision", "PaceConfig", "PrefillAfterDecode", "Rounding", "Scales", "check_choice",
    "check_int", "default_of", "get_config", "is_int", "tagged",
]
