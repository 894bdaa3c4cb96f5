"""The seed articles' claims about PACE, measured on one model (issue 15): one report, each claim with
the figures it rests on and its margin, and the paper's main table in shape.

Claims (the configurations are built here from the named ones, so the report follows their defaults):

- **(a) periodic rounding**: RTN, value-axis groups of 32, rounded every dP = 8 tokens (with PACE-4's
  decode buffer) against every token (dP = 1), at 3-6 bits: KL to fp32, top-1 agreement and the
  relative state error. Holds at a width when dP = 8 has the lower KL.
- **(b) key-axis groups**: 4-bit symmetric groups of 32 along the key axis against the value axis
  (per-token rounding, so only the grouping differs). Holds when key-axis has the lower KL.
- **(c) head allocation**: PACE-4/8 with the calibrated E_h allocation against the same share of 8-bit heads
  chosen at random (``seeds`` allocations) and against the uniform width of equal payload (5-bit groups
  of PACE-4/8's quantiser: ``5 + 16/32 + 5/32 = 5.65625`` bits, PACE-4/8's payload). Holds when E_h has
  the lowest KL.
- **(d) drift against dP**: the relative state error of the 4-bit quantisers (PACE-4's and RTN-INT4's)
  at dP = 1, 2, 4, 8, 16, compared at the steps where every dP has just rounded (multiples of 16).
  Holds for a quantiser when the error falls as dP grows.
- **(e) PACE vs STEPQuant at equal resident bits** (ours, issue 38): STEPQuant-4 (calibrated on the model)
  against the PACE-4 setting of the most resident bits not above STEPQuant-4's on the model
  (:func:`equal_bits_pace`: PACE-4's quantiser and buffer, key-axis groups, dP and group size chosen). No PACE
  setting has exactly STEPQuant's bits; "not above" means a PACE win is not bought with memory. Holds when the
  PACE setting has the lower KL.

**Spread.** Every margin comes with a 95% bootstrap interval (:data:`SPREAD_RESAMPLES` resamples, seeded):
claims (a), (b), (c) and (e) resample the perplexity windows (each scores its own tokens; the configurations
of a claim are resampled together, so the interval is that of their difference on the same text), claim (d)
the decode steps where every dP has just rounded (consecutive steps of one sequence are correlated, so its
interval is narrower than independent sequences would give). ``holds_share`` is the share of resamples in
which the claim holds; it holds **beyond the spread** when that share is at least 97.5% and fails beyond it at
2.5% or less (:func:`verdict`). Claim (c) also states its spread over the random allocations (``random``):
their mean KL and standard deviation, and E_h's margin over their mean.

The main table: PACE-4, PACE-4/8 with each buffer, DAMP INT4 / INT8, Q-Mamba DSQ, RTN-INT4 / INT8, each
with its resident bits (loaded model and Qwen3.5-27B), bpb, KL and agreement.

KL, agreement and bpb come from one :func:`pace_core.analysis.quality.perplexity_run` of all
configurations on the text (the fp32 reference shared; each window's scored tokens decoded, as the
``perplexity`` command does by default); state errors from one
:func:`pace_core.analysis.drift.drift` run on its first ``drift_tokens`` tokens.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch

from pace_core.accounting import resident_bits
from pace_core.analysis.drift import drift, drift_progress_total
from pace_core.analysis.quality import QualityRun, perplexity_run, quality_progress_total
from pace_core.analysis.text import read_text, tokenize
from pace_core.config import PaceConfig, get_config, tagged
from pace_core.errors import PaceError
from pace_core.export import config_to_json
from pace_core.shapes import BUILTIN_SHAPES, ModelShape

if TYPE_CHECKING:
    from pace_core.model.loading import LoadedModel

CLAIM_BITS = (3, 4, 5, 6)
DRIFT_PERIODS = (1, 2, 4, 8, 16)
MAIN_BUFFERS = ("mixed", "int8", "bf16", "fp32")
REPORT_SHAPE = "qwen3.5-27b"
EQUAL_BITS_PERIODS = (2, 4, 8, 16)
EQUAL_BITS_GROUPS = (32, 64, 128)
"""The decode periods and group sizes :func:`equal_bits_pace` chooses from (dP >= 2: periodic rounding, PACE's
own; group sizes that divide the model's key axis)."""
(STEPQUANT,) = tagged("equal-bits-rival")
"""Claim (e)'s rival of PACE-4 at equal resident bits (STEPQuant-4)."""
CALIBRATED = tuple(
    name for name in ("pace-4-8", *tagged("paper-table"), STEPQUANT) if get_config(name).needs_calibration
)
"""The named configurations of the report calibrated on the model first (PACE-4/8's heads, the main table's and the
rival's calibrated tensors)."""
SPREAD_RESAMPLES = 2000
SPREAD_LEVEL = 0.95
SPREAD_SEED = 0
"""The bootstrap of every margin (module docstring): resamples, interval level, seed of the draws."""


@dataclass(frozen=True)
class ClaimConfigs:
    """The configurations of each claim (``{label: config}``); ``random_allocations`` are filled in by
    :func:`random_allocations` once the calibrated configuration is known."""

    periodic: dict[str, PaceConfig]
    axis: dict[str, PaceConfig]
    allocation: dict[str, PaceConfig]
    drift: dict[str, PaceConfig]
    main: dict[str, PaceConfig]
    stepquant: dict[str, PaceConfig]

    def quality(self) -> dict[str, PaceConfig]:
        """Every configuration scored on the text, once each."""
        return {**self.periodic, **self.axis, **self.allocation, **self.main, **self.stepquant}


def _with_buffer_of(cfg: PaceConfig, other: PaceConfig) -> PaceConfig:
    """``cfg`` with the decode buffer of ``other`` (precision, groups, zero points)."""
    return cfg.replace(buffer=other.buffer, buffer_key_group=other.buffer_key_group,
                       buffer_value_group=other.buffer_value_group, buffer_key_symmetric=other.buffer_key_symmetric,
                       buffer_value_symmetric=other.buffer_value_symmetric)


def equal_bits_pace(bits: float, shape: ModelShape) -> PaceConfig:
    """The PACE-4 setting of claim (e) for a rival of ``bits`` resident bits on ``shape``: PACE-4 (its quantiser,
    key-axis groups and decode buffer) at the decode period of :data:`EQUAL_BITS_PERIODS` and the group size of
    :data:`EQUAL_BITS_GROUPS` (those dividing the key axis) whose resident bits are the most not above ``bits``
    (none: the fewest), named ``pace-4 dP<p> g<g>``."""
    pace4 = get_config("pace-4")
    options = [pace4.replace(name=f"pace-4 dP{p} g{g}", decode_period=p, group_size=g)
               for p in EQUAL_BITS_PERIODS for g in EQUAL_BITS_GROUPS if shape.d_k % g == 0]
    have = {cfg.name: resident_bits(cfg, shape).resident_bits for cfg in options}
    return min(options, key=lambda cfg: (have[cfg.name] > bits, abs(have[cfg.name] - bits)))


def claim_configs(calibrated_pace48: PaceConfig, random_heads: list[tuple[tuple[int, ...], ...]], shape: ModelShape,
                  calibrated: Mapping[str, PaceConfig] | None = None) -> ClaimConfigs:
    """The configurations of the report on a model of ``shape``. ``calibrated_pace48``: PACE-4/8 with its
    calibrated E_h heads; ``random_heads``: the random allocations of claim (c) (:func:`random_allocations`);
    ``calibrated``: named configurations calibrated on the model (the main table's DAMP and claim (e)'s
    STEPQuant-4; the rest are taken as named)."""
    pace4 = get_config("pace-4")
    rtn = _with_buffer_of(get_config("rtn-int4").replace(group_axis="value", group_size=32), pace4)
    periodic = {}
    for b in CLAIM_BITS:
        periodic[f"rtn{b} value g32 dP1"] = rtn.replace(name=f"rtn{b}-v32-dp1", bits=b, decode_period=1)
        periodic[f"rtn{b} value g32 dP8"] = rtn.replace(name=f"rtn{b}-v32-dp8", bits=b, decode_period=8)
    axis = {f"4-bit {a}-axis g32": rtn.replace(name=f"rtn4-{a}32", group_axis=a) for a in ("key", "value")}
    allocation = {"pace-4-8 E_h": calibrated_pace48.replace(name="pace-4-8-Eh")}
    for i, heads in enumerate(random_heads):
        allocation[f"pace-4-8 random {i}"] = calibrated_pace48.replace(name=f"pace-4-8-random{i}", high_heads=heads)
    allocation["uniform 5-bit (equal payload)"] = calibrated_pace48.replace(
        name="pace-5-uniform", bits=5, high_share=0.0, high_heads=None)
    drift_cfgs = {}
    for name, base in (("pace-4", pace4), ("rtn-int4", _with_buffer_of(get_config("rtn-int4"), pace4))):
        for p in DRIFT_PERIODS:
            drift_cfgs[f"{name} dP{p}"] = base.replace(name=f"{name}-dp{p}", decode_period=p)
    main = {"pace-4": pace4}
    for buf in MAIN_BUFFERS:
        main[f"pace-4-8 ({buf} buffer)"] = calibrated_pace48.replace(name=f"pace-4-8-{buf}", buffer=buf)
    for name in tagged("paper-table"):
        main[name] = (calibrated or {}).get(name) or get_config(name)
    rival = (calibrated or {}).get(STEPQUANT) or get_config(STEPQUANT)
    pace = equal_bits_pace(resident_bits(rival, shape).resident_bits, shape)
    return ClaimConfigs(periodic, axis, allocation, drift_cfgs, main, {pace.name: pace, STEPQUANT: rival})


def random_allocations(cfg: PaceConfig, layers: int, heads: int, seeds: int) -> list[tuple[tuple[int, ...], ...]]:
    """``seeds`` allocations of ``cfg``'s share of high-bit heads, chosen uniformly at random per layer
    (seed i draws with ``torch.Generator().manual_seed(i)``), none equal to ``cfg.high_heads``."""
    per_layer = len(cfg.high_heads[0]) if cfg.high_heads else 0
    out: list[tuple[tuple[int, ...], ...]] = []
    seed = 0
    while len(out) < seeds:
        gen = torch.Generator().manual_seed(seed)
        seed += 1
        alloc = tuple(tuple(sorted(torch.randperm(heads, generator=gen)[:per_layer].tolist())) for _ in range(layers))
        if alloc != cfg.high_heads and alloc not in out:
            out.append(alloc)
        if seed > 1000 * seeds:
            raise PaceError("random allocations: the model has too few heads for distinct random allocations")
    return out


def _unique(configs: Mapping[str, PaceConfig]) -> tuple[dict[str, PaceConfig], dict[str, str]]:
    """Configurations to run once each (by their JSON) and the run name of every label."""
    by_json: dict[str, str] = {}
    run: dict[str, PaceConfig] = {}
    alias: dict[str, str] = {}
    for label, cfg in configs.items():
        key = config_to_json(cfg.replace(name="x"))
        if key not in by_json:
            by_json[key] = label
            run[label] = cfg
        alias[label] = by_json[key]
    return run, alias


def _configs(loaded: LoadedModel, calibrated_pace48: PaceConfig, seeds: int,
             calibrated: Mapping[str, PaceConfig] | None = None) -> ClaimConfigs:
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise PaceError(f"seeds: {seeds!r} not allowed; allowed: an integer >= 1")
    shape = loaded.shape
    return claim_configs(calibrated_pace48, random_allocations(calibrated_pace48, shape.num_gdn_layers,
                                                               shape.num_v_heads, seeds), shape, calibrated)


def quality_configs(loaded: LoadedModel, calibrated_pace48: PaceConfig, seeds: int,
                    calibrated: Mapping[str, PaceConfig] | None = None) -> dict[str, PaceConfig]:
    """The configurations the report scores on its text, once each, each named by its label (so their
    perplexity results can be stored and reused one by one; :func:`measure_claims`' ``quality``);
    ``calibrated`` as in :func:`measure_claims`."""
    run, _ = _unique(_configs(loaded, calibrated_pace48, seeds, calibrated).quality())
    return {label: cfg.replace(name=label) for label, cfg in run.items()}


def claims_progress_total(
    loaded: LoadedModel,
    calibrated_pace48: PaceConfig,
    seeds: int,
    n_tokens: int,
    window: int,
    stride: int,
    batch: int,
    drift_tokens: int,
    groups: Sequence[int] | None = None,
    calibrated: Mapping[str, PaceConfig] | None = None,
) -> int:
    """The progress units of :func:`measure_claims` on ``n_tokens`` tokens of its text. ``groups``: the sizes of
    the groups of configurations whose perplexity is measured in one :func:`perplexity_run` call each (each with
    its own run of the reference; none when all are stored); None: all of them in one call, as
    :func:`measure_claims` does without ``quality``; ``calibrated`` as there. ``drift_tokens``: the tokens of the
    drift sequence, read from the text independently of ``n_tokens`` (:func:`drift_sequence`)."""
    cfgs = _configs(loaded, calibrated_pace48, seeds, calibrated)
    if groups is None:
        groups = [len(_unique(cfgs.quality())[0])]
    T = drift_tokens
    states = len({**cfgs.drift, **cfgs.periodic, **cfgs.axis})
    return (sum(quality_progress_total(loaded, n, n_tokens, window, stride, max(window - stride, 1), batch)
                for n in groups)
            + drift_progress_total(loaded, states, T, T // 2))


def drift_sequence(loaded: LoadedModel, text: str | os.PathLike, drift_tokens: int) -> torch.Tensor:
    """``ids [1, T]``: the first ``drift_tokens`` tokens of ``text`` (fewer if it is shorter), of which claims (c)
    and (d) decode the second half; refused when that half is shorter than the longest period they compare."""
    ids = tokenize(loaded.tokenizer, read_text(text), drift_tokens)
    least = 2 * max(DRIFT_PERIODS)
    if ids.shape[1] < least:
        raise PaceError(f"drift tokens: {ids.shape[1]} not allowed (the text has {ids.shape[1]} of the "
                        f"{drift_tokens} asked); allowed: at least {least}, so that the decoded half reaches a "
                        f"multiple of every period compared ({', '.join(map(str, DRIFT_PERIODS))})")
    return ids


def _margin(better: float, other: float) -> float:
    """Relative margin of ``better`` over ``other`` (KL or error: lower is better): 1 - better/other."""
    return 1.0 - better / other if other > 0 else 0.0


def resample_counts(n: int) -> np.ndarray:
    """``[SPREAD_RESAMPLES, n]``: how often each of ``n`` units is drawn in each bootstrap resample (``n`` draws
    with replacement; seeded by :data:`SPREAD_SEED`, so a report is reproducible)."""
    if n < 1:
        raise PaceError("spread: no units to resample; allowed: at least one window or decode step")
    draws = np.random.default_rng(SPREAD_SEED).integers(0, n, size=(SPREAD_RESAMPLES, n))
    counts = np.zeros((SPREAD_RESAMPLES, n))
    np.add.at(counts, (np.arange(SPREAD_RESAMPLES)[:, None], draws), 1.0)
    return counts


def spread(margins: np.ndarray, holds: np.ndarray, unit: str, n: int) -> dict:
    """The spread of a margin over ``SPREAD_RESAMPLES`` resamples of ``n`` ``unit`` (``margins [R]``, ``holds [R]``
    whether the claim holds in each): the central :data:`SPREAD_LEVEL` interval ``low``, ``high`` and
    ``holds_share``, the share of resamples in which it holds."""
    tail = (1 - SPREAD_LEVEL) / 2
    low, high = np.quantile(margins, [tail, 1 - tail])
    return {"unit": unit, "n": int(n), "low": float(low), "high": float(high), "holds_share": float(np.mean(holds))}


def verdict(claim: Mapping) -> str:
    """A claim's verdict with its spread: "holds beyond the spread" (it holds in at least 97.5% of the
    resamples), "fails beyond the spread" (in at most 2.5%), else "within the spread"; "no spread measured" for
    a report made before spreads were."""
    if "spread" not in claim:
        return "no spread measured"
    share, tail = claim["spread"]["holds_share"], (1 - SPREAD_LEVEL) / 2
    return "holds beyond the spread" if share >= 1 - tail else "fails beyond the spread" if share <= tail else (
        "within the spread")


def _window_kl(windows: pd.DataFrame, names: Mapping[str, str]) -> tuple[np.ndarray, np.ndarray]:
    """``(kl [windows, labels], tokens [windows])``: each label's KL sum per window (``names``: label -> the
    configuration name its rows carry), in window order."""
    kl = windows.pivot(index="window", columns="config", values="kl")
    tokens = windows.pivot(index="window", columns="config", values="tokens")
    run = list(dict.fromkeys(names.values()))
    absent = [name for name in run if name not in kl.columns]
    if absent:
        raise PaceError(f"quality: no per-window rows for {', '.join(absent)}; allowed: the windows of every "
                        "quality_configs label")
    return kl[[names[label] for label in names]].to_numpy(), tokens[run[0]].to_numpy()


def _kl_spread(windows: pd.DataFrame, better: str, others: Sequence[str], alias: Mapping[str, str]) -> dict:
    """The spread over the windows of ``1 - KL(better) / min KL(others)``."""
    labels = [better, *others]
    kl, tokens = _window_kl(windows, {label: alias[label] for label in labels})
    counts = resample_counts(len(tokens))
    resampled = (counts @ kl) / (counts @ tokens)[:, None]  # [resamples, labels]: each label's KL
    rival = resampled[:, 1:].min(axis=1)
    margins = 1.0 - resampled[:, 0] / np.where(rival > 0, rival, np.inf)
    return spread(margins, resampled[:, 0] < rival, "windows", len(tokens))


def measure_claims(loaded: LoadedModel, text: str | os.PathLike, calibrated_pace48: PaceConfig, *,
                   max_tokens: int | None = None, window: int = 512, stride: int = 256, batch: int = 8,
                   seeds: int = 5, drift_tokens: int = 512, calibrated: Mapping[str, PaceConfig] | None = None,
                   quality: QualityRun | None = None, progress: Callable[[int], None] | None = None) -> dict:
    """The report (module docstring) as plain data: ``{"claims": [...], "main": [...], "quality": [...],
    "drift": [...]}``. ``calibrated``: the named configurations calibrated on the model where their method
    needs it (the main table's ``damp-int4``, ``damp-int8``; claim (e)'s ``stepquant-4``).
    ``quality``: the perplexity rows and windows (:func:`pace_core.analysis.quality.perplexity_run`, same text
    and window) of every :func:`quality_configs` label, already measured; without it they are measured here."""
    shape = loaded.shape
    cfgs = _configs(loaded, calibrated_pace48, seeds, calibrated)
    run, alias = _unique(cfgs.quality())
    if quality is None:
        quality = perplexity_run(loaded, run, text, window=window, stride=stride, max_tokens=max_tokens,
                                 batch=batch, decode_from=max(window - stride, 1), progress=progress)
    windows = quality.windows
    quality = quality.table.set_index("config")
    absent = [label for label in run if label not in quality.index]
    if absent:
        raise PaceError(f"quality: no perplexity row for {', '.join(absent)}; allowed: a row per quality_configs label")
    q = {label: quality.loc[alias[label]] for label in cfgs.quality()}

    ids = drift_sequence(loaded, text, drift_tokens)
    decode_from = ids.shape[1] // 2
    state_cfgs = {**cfgs.drift, **cfgs.periodic, **cfgs.axis}
    dres = drift(loaded, state_cfgs, ids, decode_from, every=1, progress=progress)
    common = [j for j in dres.table.step.unique() if j > 0 and j % max(DRIFT_PERIODS) == 0]
    at_common = dres.table[dres.table.step.isin(common)].pivot(index="step", columns="config", values="rel_error")
    err = {label: float(at_common[label].mean()) for label in state_cfgs}

    claims = []
    for b in CLAIM_BITS:
        one, eight = f"rtn{b} value g32 dP1", f"rtn{b} value g32 dP8"
        bits = [resident_bits(cfgs.periodic[label], shape).resident_bits for label in (eight, one)]
        claims.append({"claim": "a", "what": f"{b}-bit RTN (value g32): dP 8 vs dP 1", "labels": [eight, one],
                       "holds": bool(q[eight].kl < q[one].kl), "margin": _margin(q[eight].kl, q[one].kl),
                       "spread": _kl_spread(windows, eight, [one], alias), "resident_bits": bits,
                       "kl": [float(q[eight].kl), float(q[one].kl)],
                       "agreement": [float(q[eight].agreement), float(q[one].agreement)],
                       "state_error": [err[eight], err[one]]})
    key, value = "4-bit key-axis g32", "4-bit value-axis g32"
    claims.append({"claim": "b", "what": "4-bit groups of 32: key axis vs value axis", "labels": [key, value],
                   "holds": bool(q[key].kl < q[value].kl), "margin": _margin(q[key].kl, q[value].kl),
                   "spread": _kl_spread(windows, key, [value], alias),
                   "kl": [float(q[key].kl), float(q[value].kl)],
                   "agreement": [float(q[key].agreement), float(q[value].agreement)],
                   "state_error": [err[key], err[value]]})
    randoms = [label for label in cfgs.allocation if "random" in label]
    best_random = min(randoms, key=lambda label: q[label].kl)
    uniform = "uniform 5-bit (equal payload)"
    eh = "pace-4-8 E_h"
    random_kl = np.array([float(q[label].kl) for label in randoms])
    claims.append({"claim": "c", "what": f"E_h allocation vs the best of {len(randoms)} random allocations and the "
                                         "uniform 5-bit width of equal payload", "labels": [eh, best_random, uniform],
                   "holds": bool(q[eh].kl < min(q[best_random].kl, q[uniform].kl)),
                   "margin": _margin(q[eh].kl, min(q[best_random].kl, q[uniform].kl)),
                   "spread": _kl_spread(windows, eh, [*randoms, uniform], alias),
                   "random": {"n": len(randoms), "kl_mean": float(random_kl.mean()),
                             "kl_sd": float(random_kl.std(ddof=1)) if len(randoms) > 1 else 0.0,
                             "margin_vs_mean": _margin(q[eh].kl, float(random_kl.mean())),
                             "below_all": bool(q[eh].kl < random_kl.min())},
                   "kl": [float(q[eh].kl), float(q[best_random].kl), float(q[uniform].kl)],
                   "random_kl": random_kl.tolist(),
                   "agreement": [float(q[eh].agreement), float(q[best_random].agreement), float(q[uniform].agreement)]})
    steps = resample_counts(len(common))
    for name in ("pace-4", "rtn-int4"):
        labels = [f"{name} dP{p}" for p in DRIFT_PERIODS]
        errors = [err[label] for label in labels]
        falls = all(later < earlier for earlier, later in zip(errors, errors[1:]))
        resampled = steps @ at_common[labels].to_numpy() / len(common)  # [resamples, dPs]: each dP's mean error
        claims.append({"claim": "d", "what": f"{name}: state error at common flush points vs dP {list(DRIFT_PERIODS)}",
                       "labels": labels, "holds": falls, "margin": _margin(errors[-1], errors[0]),
                       "spread": spread(1.0 - resampled[:, -1] / resampled[:, 0],
                                        (np.diff(resampled, axis=1) < 0).all(axis=1), "decode steps", len(common)),
                       "state_error": errors})
    pace, rival = cfgs.stepquant
    bits = [resident_bits(cfgs.stepquant[label], shape).resident_bits for label in (pace, rival)]
    claims.append({"claim": "e", "what": f"{pace} ({bits[0]:.3f} bits) vs {rival} ({bits[1]:.3f} bits), the PACE "
                                         "setting of the most resident bits not above STEPQuant's",
                   "labels": [pace, rival], "holds": bool(q[pace].kl < q[rival].kl),
                   "margin": _margin(q[pace].kl, q[rival].kl), "spread": _kl_spread(windows, pace, [rival], alias),
                   "resident_bits": bits, "kl": [float(q[pace].kl), float(q[rival].kl)],
                   "agreement": [float(q[pace].agreement), float(q[rival].agreement)]})

    main = []
    for label, cfg in cfgs.main.items():
        row = q[label]
        main.append({"config": label, "resident_bits": resident_bits(cfg, shape).resident_bits,
                     "resident_bits_27b": resident_bits(cfg.uncalibrated(),  # 27B: the share, not the heads
                                                        BUILTIN_SHAPES[REPORT_SHAPE]).resident_bits,
                     "bpb": float(row.bpb), "kl": float(row.kl), "agreement": float(row.agreement)})
    quality_rows = [{"label": label, "config": config_to_json(cfg), **{k: float(q[label][k]) for k in
                                                                        ("nll", "ppl", "agreement", "kl", "bpb")}}
                    for label, cfg in cfgs.quality().items()]
    return {"claims": claims, "main": main, "quality": quality_rows,
            "drift": [{"label": label, "mean_rel_error_common_flush": err[label]} for label in state_cfgs],
            "tokens": int(quality.iloc[0].tokens), "drift_tokens": int(ids.shape[1]),
            "common_flush_steps": [int(j) for j in common]}


def claims_table(report: dict) -> pd.DataFrame:
    """One row per claim: claim, what, holds, margin (relative KL or error reduction), low and high (its
    interval over the resamples; NaN in a report made before spreads), verdict (:func:`verdict`). In every
    claim the figure lists (``kl``, ``agreement``, ``state_error``, ``resident_bits``) follow ``labels``: the
    claimed better one first, then what it is compared with (claim (d): the dPs in ascending order)."""
    return pd.DataFrame([{**{k: c[k] for k in ("claim", "what", "holds", "margin")},
                          "low": c["spread"]["low"] if "spread" in c else float("nan"),
                          "high": c["spread"]["high"] if "spread" in c else float("nan"), "verdict": verdict(c)}
                         for c in report["claims"]])
