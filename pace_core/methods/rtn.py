"""RTN (method ``rtn``): uniform round to nearest of the whole state in groups (PACE_SPEC §6's uniform
baseline, value-axis groups of 32, per-token rounding; raising dP gives its "every dP" variant with an int8
buffer, which isolates the period's effect)."""

from __future__ import annotations

from pace_core.methods import groups
from pace_core.methods.base import Method, register

# The per-token baselines (dP = 1) carry buffer "int8": unused at dP = 1, it is the buffer of their "every dP"
# variants (spec §6: "RTN-INTb, dP ... int8"), so raising decode_period gives that variant.
METHOD = register(Method(
    name="rtn", order=10, label="RTN",
    description="round-to-nearest integer state (the paper's uniform baseline)",
    reads=groups.READS, group_axes=("key", "value"), head_widths=True, kernels=True, pool=True,
    format=groups.GroupFormat, payload=groups.payload, layer_bytes=groups.layer_bytes,
    fixed_bytes=groups.fixed_bytes, groups_along=groups.groups_along, composes=groups.COMPOSES,
    calibration=groups.calibration, calibrate=groups.calibrate, check_for=groups.check_for,
    named={f"rtn-int{b}": dict(bits=b, group_axis="value", group_size=32, symmetric=True, decode_period=1,
                               buffer="int8") for b in range(2, 9)},
    tags={**{f"rtn-int{b}": ("cli-default", "all", "paper-table", "memory-page", "pool") for b in (4, 8)},
          "rtn-int3": ("memory-page",)}))
