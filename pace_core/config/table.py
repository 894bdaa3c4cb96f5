"""The settings table: every setting's :class:`~pace_core.settings.Setting` (PaceConfig's fields, then each method's
own), with its JSON key, the record schema that added it, the app's control (URL key, label, help, choices) and the
CLI flag. The record's keys, the export's names, the sidebar's controls and URL aliases, and the ``bits`` overrides
are all derived from it."""

from __future__ import annotations

from pace_core.config.fields import (
    BUFFER_PRECISIONS,
    METHODS,
    PREFILL_AFTER_DECODE,
    QUANT_BITS,
    REFERENCE_DTYPES,
    ROUNDINGS,
    SCALES,
)
from pace_core.methods import METHODS as _METHODS
from pace_core.methods import method_of
from pace_core.methods.groups import STATIC_MARGIN
from pace_core.quant import GROUP_AXES
from pace_core.settings import Setting


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
    Setting("calibrated", schema=5, before=None, read_if=lambda cfg: method_of(cfg).calibration(cfg) is not None),
    *(st for method in _METHODS.values() for st in method.settings),
)
"""Every setting's :class:`~pace_core.settings.Setting`: PaceConfig's fields, then each method's own settings
(held in ``options``); the app's controls in this order."""
SETTING_OF: dict[str, Setting] = {s.field: s for s in SETTINGS}
