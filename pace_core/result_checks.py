"""Checks of a stored result, per kind, when it is read and before it is stored (:mod:`pace_core.results`).

Each check asks for the fields the pages and the CLI read (a result missing one would break them) and
for numbers that can be right: finite, in their range (errors, KL and NLL >= 0, agreements in [0, 1],
perplexity = exp(NLL) > 1, ratios of a maximum to a median >= 1), the fp32 reference equal to itself
(KL 0, agreement 1, no divergence), and a small state error where the arithmetic bounds it
(:func:`state_error_bound`). A failed check raises PaceError with the reason; the results module reports
the file as damaged. Kinds not listed here (none that the CLI stores) get only the results module's
checks of the document.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pandas as pd

from pace_core.config import NAMED_CONFIGS, PaceConfig
from pace_core.errors import PaceError
from pace_core.export import config_from_dict
from pace_core.frontier import Point, frontier
from pace_core.methods import method_of

REFERENCE = "fp32"
"""The name of the reference configuration every per-configuration command measures against."""

BF16_ROUNDING = 2.0 ** -8 / math.sqrt(3)
"""RMS relative error of one rounding to bfloat16: 8 significant bits, unit roundoff u = 2^-8, the relative
error spread evenly over [-u, u] (RMS u / sqrt(3), about 2^-9)."""

FP32_ORDER = 2.0 ** -20
"""Relative error allowed to a float32 state that is not rounded at all (method none, float32): float32
arithmetic in another order than the reference's (u = 2^-24), up to 16 units."""

PROPAGATION = 2.0
"""Allowance for errors that reach a layer through its inputs (earlier layers' outputs computed from rounded
states), which the per-layer argument of :func:`state_error_bound` leaves out. The embedded model measures
0.2-0.3 of the per-layer bound after 32 decode steps (bf16 0.35 %, rtn-int8 1.5 %) and under 0.05 after 512."""

RECORD_ENTRIES = 256
"""The most entries of a buffered key or value vector (a head dimension) sharing one int8 scale."""


def check_result(result: Any) -> None:
    """Check a :class:`pace_core.results.Result` by its kind; PaceError naming what is wrong."""
    check = _CHECKS.get(result.kind)
    if check is not None:
        try:
            check(result.data, result.table)
        except PaceError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as err:  # a field of an unexpected form
            raise PaceError(f"a field is malformed ({type(err).__name__}: {err})") from None


def state_error_bound(cfg: Any, roundings: int) -> float | None:
    """Upper bound of the typical (median) relative state error of ``cfg`` (a PaceConfig) after
    ``roundings`` roundings, or None where the arithmetic gives no small bound (fewer than 8 bits, Q-Mamba's
    row x column scales, a 4-bit buffer).

    One rounding of a group of g values to b-bit symmetric codes has steps of max|x| / (2^(b-1) - 1) and a
    rounding error of RMS step / sqrt(12); since max|x| <= sqrt(g) RMS(x), its RMS relative error is at most
    r = sqrt(g) / ((2^(b-1) - 1) sqrt(12)) (zero points give steps no coarser). 8-bit groups of 32: 1.3 %; an
    int8 record of up to 256 entries per scale: 3.6 %. bf16: :data:`BF16_ROUNDING`; an unrounded fp32 state:
    :data:`FP32_ORDER`. The gated delta rule's transition ``exp(g) (I - beta k k^T)`` (unit keys, beta in
    [0, 1]) does not grow an error, so independent roundings add up at most as a random walk, r sqrt(n); times
    :data:`PROPAGATION` for the errors that arrive through the layer's inputs. The key rotation keeps the bound
    (orthonormal: the rotated groups obey it and the error keeps its norm), stochastic rounding's error variance
    p (1 - p) step^2 <= step^2 / 4 is three times round to nearest's step^2 / 12 (r sqrt(3)); static scales give
    none (values beyond the calibrated range saturate)."""
    if not cfg.quantized:
        r = FP32_ORDER if cfg.reference_dtype == "float32" else BF16_ROUNDING
    elif method_of(cfg).grouped and cfg.bits >= 8 and cfg.scales == "dynamic":
        entries = cfg.group_size
        if cfg.buffered:
            if cfg.buffer not in ("fp32", "bf16", "int8"):
                return None
            entries = max(entries, RECORD_ENTRIES if cfg.buffer == "int8" else 0)
        r = math.sqrt(entries) / ((2 ** (cfg.bits - 1) - 1) * math.sqrt(12))
        if cfg.rounding == "stochastic":
            r *= math.sqrt(3)
    else:
        return None
    return PROPAGATION * r * math.sqrt(max(roundings, 1))


# ----------------------------------------------------------------------------- helpers


def _fields(d: Any, names: Iterable[str], where: str) -> dict:
    if not isinstance(d, dict):
        raise PaceError(f"{where} is not an object")
    missing = [n for n in names if n not in d]
    if missing:
        raise PaceError(f"{where} lacks the field{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    return d


def _columns(table: pd.DataFrame | None, names: Iterable[str]) -> pd.DataFrame:
    if table is None:
        raise PaceError("it has no table")
    missing = [n for n in names if n not in table.columns]
    if missing:
        raise PaceError(f"its table lacks the column{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    return table


def _values(values: Any, what: str, *, lo: float | None = None, hi: float | None = None,
            above: float | None = None) -> np.ndarray:
    """``values`` as floats, each finite and >= ``lo``, <= ``hi``, > ``above`` (those given)."""
    a = np.atleast_1d(np.asarray(values, dtype=float))
    bad = ~np.isfinite(a)
    if lo is not None:
        bad |= a < lo
    if hi is not None:
        bad |= a > hi
    if above is not None:
        bad |= a <= above
    if bad.any():
        allowed = ", ".join(s for s in (f">= {lo:g}" if lo is not None else "", f"<= {hi:g}" if hi is not None else "",
                                        f"> {above:g}" if above is not None else "") if s)
        raise PaceError(f"{what} is {float(a[bad][0])!r}; allowed: finite{', ' + allowed if allowed else ''}")
    return a


def _config_of(data: dict) -> Any | None:
    """The configuration a per-configuration result was measured with: its ``configuration`` (stored since
    method version 1), else the named configuration of its ``config`` (older results), else None."""
    if "configuration" in data:
        return config_from_dict(data["configuration"])
    return NAMED_CONFIGS.get(data.get("config"))


def _quality_row(row: Any, where: str) -> None:
    """A perplexity row: config, tokens, nll, ppl, agreement, kl, bpb; the reference's KL 0, agreement 1."""
    _fields(row, ("config", "tokens", "nll", "ppl", "agreement", "kl", "bpb"), where)
    name = row["config"]
    _values(row["tokens"], f"{name}'s scored tokens", above=0)
    nll = float(_values(row["nll"], f"{name}'s NLL", lo=0)[0])
    ppl = float(_values(row["ppl"], f"{name}'s perplexity", above=1)[0])
    if not math.isclose(ppl, math.exp(nll), rel_tol=1e-9):
        raise PaceError(f"{name}'s perplexity {ppl!r} is not exp(NLL) = {math.exp(nll)!r}")
    agreement = float(_values(row["agreement"], f"{name}'s top-1 agreement", lo=0, hi=1)[0])
    kl = float(_values(row["kl"], f"{name}'s KL", lo=0)[0])
    _values(row["bpb"], f"{name}'s bits per byte", above=0)
    if name == REFERENCE and (kl != 0 or agreement != 1):
        raise PaceError(f"the reference {REFERENCE} has KL {kl!r} and agreement {agreement!r} to itself; "
                        "allowed: exactly 0 and 1")


def _bounded(name: str, cfg: Any, errors: Any, roundings: int, what: str) -> None:
    """The median of ``errors`` of configuration ``name`` within :func:`state_error_bound`."""
    bound = None if cfg is None else state_error_bound(cfg, roundings)
    median = float(np.median(errors))
    if bound is not None and median > bound:
        raise PaceError(f"{name}'s median {what} is {median:.4g}; allowed for {cfg.method} "
                        f"{cfg.reference_dtype if not cfg.quantized else f'{cfg.bits}-bit'} over {roundings} "
                        f"roundings: at most {bound:.3g} (pace_core.result_checks.state_error_bound)")


# ----------------------------------------------------------------------------- kinds


def _model_card(data: dict, table: pd.DataFrame | None) -> None:
    _fields(data, ("source", "shape", "summary", "fingerprint"), "the data")
    _fields(data["shape"], (), "shape")
    _fields(data["summary"], (), "summary")


def _calibration(data: dict, table: pd.DataFrame | None) -> None:
    _fields(data, ("config", "layers", "a", "e", "E", "tokens", "samples"), "the data")
    cfg = config_from_dict(data["config"])
    shape = (len(data["layers"]),)
    for name, what, hi in (("a", "a head's decay a_h", 1), ("e", "a head's rounding error e_h", None),
                           ("E", "a head's retained error E_h", None)):
        values = np.asarray(data[name], dtype=float)
        if values.ndim != 2 or values.shape[:1] != shape:
            raise PaceError(f"{name} has shape {values.shape}; allowed: one row of heads per layer of {data['layers']}")
        _values(values, what, lo=0, hi=hi)
    if cfg.calibrated is not None and len(cfg.calibrated.layers) != shape[0]:
        raise PaceError(f"the configuration's calibrated tensors have {len(cfg.calibrated.layers)} layers; allowed: "
                        f"one per layer of {data['layers']}")
    _values([data["tokens"], data["samples"]], "the calibration's tokens or samples", above=0)
    _columns(table, ("layer", "gdn_index", "head", "a", "e", "E", "high"))


def _drift(data: dict, table: pd.DataFrame | None) -> None:
    _fields(data, ("config", "summary", "decode_from", "tokens"), "the data")
    summary = _fields(data["summary"], ("config", "mean_rel_error", "final_rel_error", "mean_excess_nll"),
                      "the summary")
    name = data["config"]
    _values([summary["mean_rel_error"], summary["final_rel_error"]], f"{name}'s relative state error", lo=0)
    _values(summary["mean_excess_nll"], f"{name}'s excess NLL")
    table = _columns(table, ("config", "step", "rel_error", "excess_nll"))
    _values(table["step"], "a step", lo=0)
    errors = _values(table["rel_error"], f"{name}'s relative state error", lo=0)
    _values(table["excess_nll"], f"{name}'s excess NLL")
    decoded = int(data["tokens"]) - int(data["decode_from"])
    _bounded(name, _config_of(data), errors, decoded + 1, "relative state error")  # the prefill's rounding too


def _structure(data: dict, table: pd.DataFrame | None) -> None:
    _fields(data, ("tokens", "threshold", "summary"), "the data")
    for row in data["summary"]:
        _fields(row, ("layer", "col_ratio_median", "col_ratio_max", "row_ratio_median", "row_ratio_max",
                      "outlier_cols"), "a summary row")
    table = _columns(table, ("layer", "head", "col_rms_max", "col_rms_median", "col_ratio", "row_rms_max",
                             "row_rms_median", "row_ratio", "outlier_cols"))
    _values(table[["col_rms_max", "col_rms_median", "row_rms_max", "row_rms_median"]].to_numpy(), "a column or "
            "row RMS", lo=0)
    _values(table[["col_ratio", "row_ratio"]].to_numpy(), "a ratio of the largest to the median RMS", lo=1)
    _values(table["outlier_cols"], "a count of outlier columns", lo=0)


WINDOW_SUM_TOLERANCE = 1e-9
"""Relative difference allowed between a row's NLL or KL and its windows' sums: float64 sums of the same terms in
another order (a few units of 2^-52 per term over up to ~10^6 tokens)."""


def _perplexity(data: dict, table: pd.DataFrame | None) -> None:
    """The row; and its table, where there is one (results since per-window sums were stored): a window's scored
    tokens > 0, NLL and KL >= 0 (KL up to float rounding), agreeing tokens within its tokens, the windows adding up
    to the row; the reference's KL 0 and all its tokens agreeing in every window."""
    _fields(data, ("config", "row", "decode_from"), "the data")
    row = data["row"]
    _quality_row(row, "the row")
    if table is None:
        return
    table = _columns(table, ("config", "window", "tokens", "nll", "agreed", "kl"))
    name, tokens = row["config"], table["tokens"].to_numpy()
    _values(tokens, f"{name}'s scored tokens of a window", above=0)
    _values(table["nll"], f"{name}'s NLL of a window", lo=0)
    _values(table["agreed"], f"{name}'s agreeing tokens of a window", lo=0)
    _values(table["kl"], f"{name}'s KL of a window", lo=-WINDOW_SUM_TOLERANCE * float(tokens.max()))
    if (table["agreed"].to_numpy() > tokens).any():
        raise PaceError(f"{name}: a window has more agreeing tokens than scored ones")
    if int(tokens.sum()) != int(row["tokens"]):
        raise PaceError(f"{name}: its windows score {int(tokens.sum())} tokens, its row {int(row['tokens'])}")
    for field in ("nll", "kl"):
        total, mean = float(table[field].sum()), float(row[field]) * int(row["tokens"])
        if not math.isclose(max(total, 0.0), mean, rel_tol=WINDOW_SUM_TOLERANCE, abs_tol=WINDOW_SUM_TOLERANCE):
            raise PaceError(f"{name}: its windows' {field} adds up to {total!r}, its row to {mean!r}")
    if name == REFERENCE and ((table["kl"] != 0).any() or (table["agreed"].to_numpy() != tokens).any()):
        raise PaceError(
            f"the reference {REFERENCE} differs from itself in a window; allowed: KL 0, every token agreeing"
        )


def _generation(data: dict, table: pd.DataFrame | None) -> None:
    _fields(data, ("config", "prompt"), "the data")
    table = _columns(table, ("mode", "config", "tokens", "pieces", "text", "first_divergence", "ref_nll",
                             "ref_agreement"))
    _values(table["ref_nll"], "a continuation's NLL under the reference", lo=0)
    _values(table["ref_agreement"], "a continuation's top-1 agreement", lo=0, hi=1)
    for row in table.itertuples():
        if len(row.pieces) != len(row.tokens):
            raise PaceError(f"{row.config} ({row.mode}): {len(row.pieces)} pieces for {len(row.tokens)} tokens")
        diverged = not pd.isna(row.first_divergence)
        if diverged and not 0 <= row.first_divergence <= len(row.tokens):
            raise PaceError(f"{row.config} ({row.mode}): first divergence {row.first_divergence} outside its "
                            f"{len(row.tokens)} tokens")
        if diverged and row.config == REFERENCE:
            raise PaceError(f"the reference {REFERENCE} diverges from itself at token {row.first_divergence}")


def _sweep(data: dict, table: pd.DataFrame | None) -> None:
    _fields(data, ("steps", "tokens", "decode_tokens", "mode"), "the data")
    errors = ("prefill_rel_error", "final_rel_error", "mean_rel_error", "output_rel_error")
    table = _columns(table, ("config", "bits", "decode_period", "group_axis", "group_size", "buffer",
                             "resident_bits", *errors))
    for column in errors:
        _values(table[column], f"a configuration's {column}", lo=0)
    _values(table["resident_bits"], "a configuration's resident bits", above=0)
    for row in table.itertuples():  # the grid's configurations are PACE's quantiser at these settings
        cfg = PaceConfig(name=row.config, bits=int(row.bits), group_axis=row.group_axis, group_size=int(row.group_size),
                         decode_period=int(row.decode_period), buffer=row.buffer)
        _bounded(row.config, cfg, [row.mean_rel_error], int(data["decode_tokens"]) + 1, "relative state error")


def _claims(data: dict, table: pd.DataFrame | None) -> None:
    """Each claim's fields and figures; its spread (reports since spreads were measured): an interval in order
    and a share of resamples in [0, 1]."""
    _fields(data, ("claims", "main", "tokens", "drift_tokens"), "the data")
    for claim in data["claims"]:
        _fields(claim, ("claim", "what", "labels", "holds", "margin"), "a claim")
        _values(claim["margin"], f"claim {claim['claim']}'s margin")
        if "spread" in claim:
            spread = _fields(claim["spread"], ("unit", "n", "low", "high", "holds_share"), "a claim's spread")
            low, high = map(float, _values([spread["low"], spread["high"]],
                                           f"claim {claim['claim']}'s margin interval"))
            if low > high:
                raise PaceError(f"claim {claim['claim']}'s margin interval [{low!r}, {high!r}] is not in order")
            _values(spread["holds_share"], f"claim {claim['claim']}'s share of resamples", lo=0, hi=1)
            _values(spread["n"], f"claim {claim['claim']}'s resampled units", above=0)
        if "resident_bits" in claim:  # claims (a) (since issue 48) and (e): the bits each labelled one stores
            _values(claim["resident_bits"], f"claim {claim['claim']}'s resident bits", above=0)
        if "kl" in claim:
            _values(claim["kl"], f"claim {claim['claim']}'s KL", lo=0)
        else:
            _fields(claim, ("state_error",), "a claim without KL")
            _values(claim["state_error"], f"claim {claim['claim']}'s state error", lo=0)
    for row in data["main"]:
        _fields(row, ("config", "resident_bits", "resident_bits_27b", "bpb", "kl", "agreement"), "a main table row")
        _values([row["resident_bits"], row["resident_bits_27b"], row["bpb"]], f"{row['config']}'s bits", above=0)
        _values(row["kl"], f"{row['config']}'s KL", lo=0)
        _values(row["agreement"], f"{row['config']}'s top-1 agreement", lo=0, hi=1)
    _columns(table, ("claim", "what", "holds", "margin"))


def _compare(data: dict, table: pd.DataFrame | None) -> None:
    """Every point's fields and figures (resident bits > 0, KL >= 0, agreement in [0, 1], bpb > 0), the reference's
    KL 0, and the frontier the Pareto frontier of the points (:func:`pace_core.frontier.frontier`)."""
    _fields(data, ("points", "frontier", "tokens"), "the data")
    points = []
    for p in data["points"]:
        _fields(p, ("config", "resident_bits", "kl", "agreement", "bpb", "configuration"), "a point")
        _values(p["resident_bits"], f"{p['config']}'s resident bits", above=0)
        _values(p["kl"], f"{p['config']}'s KL", lo=0)
        _values(p["agreement"], f"{p['config']}'s top-1 agreement", lo=0, hi=1)
        _values(p["bpb"], f"{p['config']}'s bits per byte", above=0)
        if p["config"] == REFERENCE and p["kl"] != 0:
            raise PaceError(f"the reference {REFERENCE} has KL {p['kl']!r} to itself; allowed: exactly 0")
        points.append(Point.of(p))
    want = [p.config for p in frontier(points)]
    if list(data["frontier"]) != want:
        raise PaceError(f"its frontier {list(data['frontier'])} is not its points' Pareto frontier {want}")
    _columns(table, ("config", "resident_bits", "kl", "agreement", "bpb", "frontier"))


PROPORTIONS = frozenset({"acc", "acc_norm", "exact_match", "string_match_all", "prompt_level_strict_acc",
                         "prompt_level_loose_acc", "inst_level_strict_acc", "inst_level_loose_acc", "f1"})
"""lm-eval metrics that are shares of the items (or of their instructions), so in [0, 1]."""


def _task(data: dict, table: pd.DataFrame | None) -> None:
    """A task result (:mod:`pace_core.analysis.task_scores`): at least one score, each finite, a standard error
    >= 0 or none, a proportion of the items (a metric of lm-eval's that averages per-item 0/1 scores: acc,
    exact_match, ...) in [0, 1]; at least one item scored, no more than the task has; its per-item table."""
    _fields(data, ("task", "scores", "samples", "output_type", "config", "configuration"), "the data")
    if not data["scores"]:
        raise PaceError("it holds no score")
    for s in data["scores"]:
        _fields(s, ("task", "metric", "filter", "value", "stderr", "higher_is_better"), "a score")
        where = f"{s['task']} {s['metric']} ({s['filter']})"
        _values(s["value"], where)
        if s["stderr"] is not None:
            _values(s["stderr"], f"{where}'s standard error", lo=0)
        if s["metric"] in PROPORTIONS:
            _values(s["value"], where, lo=0, hi=1)
    effective, original = int(data["samples"]["effective"]), int(data["samples"]["original"])
    if not 1 <= effective <= original:
        raise PaceError(f"it scored {effective} of {original} items; allowed: 1 to all of them")
    _columns(table, ("task", "doc_id", "filter"))


_CHECKS: dict[str, Callable[[dict, pd.DataFrame | None], None]] = {
    "model_card": _model_card, "calibration": _calibration, "drift": _drift, "structure": _structure,
    "perplexity": _perplexity, "claims_quality": _perplexity, "generation": _generation, "sweep": _sweep,
    "claims": _claims, "compare": _compare, "task": _task,
}
"""The check of each kind the CLI stores."""
