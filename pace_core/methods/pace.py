"""PACE (method ``pace``): periodic rounding with a decode buffer, key-axis (channel-aligned) scale groups, and
head-level 8-bit allocation (PACE_SPEC §2-§4, §6: PACE-4 and PACE-4/8); PACE-3, PACE-4 at 3 bits
(issue 48: the codes stored densely, 3.25 + c·dP resident bits; PACE-4/8 at 3 bits is not named: on the
embedded model it stores more than PACE-4 for a higher KL, 6.06 bits at 3.10e-4 against 5.03 at 2.82e-4 on the
first 4,096 test tokens); and PACE-4 with each combination the
paper lists as untested (:mod:`pace_core.methods.groups`): ``pace-4-sr`` (stochastic rounding, seed 0),
``pace-4-hadamard`` (Hadamard rotation along the key axis), ``pace-4-static`` (static scales calibrated per
layer)."""

from __future__ import annotations

from pace_core.methods import groups
from pace_core.methods.base import Method, register

PACE_4 = dict(bits=4, group_axis="key", group_size=64, symmetric=True, decode_period=8, prefill_period=256,
              buffer="int8")
PACE_4_8 = dict(
    bits=4,
    high_bits=8,
    high_share=0.25,
    group_axis="key",
    group_size=32,
    symmetric=False,
    decode_period=8,
    prefill_period=256,
    buffer="mixed",
    buffer_key_group=16,
    buffer_key_symmetric=False,
)

METHOD = register(
    Method(
        name="pace",
        order=20,
        label="PACE",
        description="PACE: key-axis (channel-aligned) groups, periodic rounding, decode buffer",
        reads=groups.READS,
        group_axes=("key", "value"),
        head_widths=True,
        kernels=True,
        pool=True,
        format=groups.GroupFormat,
        payload=groups.payload,
        layer_bytes=groups.layer_bytes,
        fixed_bytes=groups.fixed_bytes,
        groups_along=groups.groups_along,
        composes=groups.COMPOSES,
        calibration=groups.calibration,
        calibrate=groups.calibrate,
        check_for=groups.check_for,
        named={
            "pace-3": dict(PACE_4, bits=3),
            "pace-4": PACE_4,
            "pace-4-8": PACE_4_8,
            "pace-4-sr": dict(PACE_4, rounding="stochastic", rounding_seed=0),
            "pace-4-hadamard": dict(PACE_4, key_hadamard=True),
            "pace-4-static": dict(PACE_4, scales="static", static_margin=groups.STATIC_MARGIN),
        },
        tags={
            **dict.fromkeys(
                ("pace-4", "pace-4-8"), ("cli-default", "all", "memory-page", "dp-curve", "pool", "serve-check")
            ),
            "pace-3": ("memory-page",),
        },
    )
)
