"""The state quantisers, one module (or package) each, found here by their registration: every module of this
package that registers a :class:`~pace_core.methods.base.Method` (a module that registers none, such as
:mod:`~pace_core.methods.groups`, holds what several share). Each holds its algorithm and declares its settings,
its capabilities, its storage format, its bytes, its calibration and its named configurations with their tags; the
rest of the code asks :func:`method_of`. Adding a method is adding a module here (with its tests), nothing else.
:data:`METHODS` lists them in their ``order``, which the app and the named configurations follow."""

import importlib
import pkgutil

from pace_core.methods.base import (
    COMBINATIONS,
    METHODS,
    Calibrated,
    LayerCalibration,
    Method,
    Sampling,
    method_of,
    register,
    state_format,
)

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")
for _method in sorted(METHODS.values(), key=lambda m: m.order):
    METHODS[_method.name] = METHODS.pop(_method.name)

__all__ = [
    "COMBINATIONS",
    "METHODS",
    "Calibrated",
    "LayerCalibration",
    "Method",
    "Sampling",
    "method_of",
    "register",
    "state_format",
]
