import numpy as np
import pandas as pd
import pytest
import torch

from pace_core.accounting import resident_bits
from pace_core.analysis.calibration import calibrate
from pace_core.analysis.claims import (
    CLAIM_BITS,
    DRIFT_PERIODS,
    EQUAL_BITS_GROUPS,
    EQUAL_BITS_PERIODS,
    SPREAD_RESAMPLES,
    SPREAD_SEED,
    claim_configs,
    claims_progress_total,
    claims_table,
    drift_sequence,
    equal_bits_pace,
    measure_claims,
    random_allocations,
    resample_counts,
    spread,
    verdict,
)
from pace_core.analysis.quality import perplexity
from pace_core.analysis.text import read_text, tokenize
from pace_core.config import get_config
from pace_core.errors import PaceError
from pace_core.model.loading import load_model
from pace_core.shapes import BUILTIN_SHAPES

pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return load_model(tiny_checkpoints["qwen3_5_text"])


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("claims") / "held-out.txt"
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    words = ["state", "gate", "delta", "head", "key", "value", "token", "decay", "round", "scale"]
    path.write_text(" ".join(words[int(i)] for i in torch.randint(0, len(words), (400,), generator=gen)))
    return path


def test_random_allocations_are_distinct_and_of_the_share(loaded):
    cfg = get_config("pace-4-8").replace(high_heads=((0,), (1,), (2,)))
    allocs = random_allocations(cfg, 3, 4, 5)
    assert len(set(allocs)) == 5 and cfg.high_heads not in allocs
    assert all(len(layer) == 1 and 0 <= layer[0] < 4 for alloc in allocs for layer in alloc)
    assert random_allocations(cfg, 3, 4, 5) == allocs  # seeded


def test_claim_configs_differ_only_where_the_claim_says():
    pace48 = get_config("pace-4-8").replace(high_heads=((0,), (1,)))
    cfgs = claim_configs(pace48, [((2,), (3,))], load_shape())
    one, eight = cfgs.periodic["rtn4 value g32 dP1"], cfgs.periodic["rtn4 value g32 dP8"]
    assert one.replace(name="x", decode_period=8) == eight.replace(name="x")
    assert eight.buffer_format == get_config("pace-4").buffer_format
    key, value = cfgs.axis.values()
    assert key.replace(name="x", group_axis="value") == value.replace(name="x")
    eh, rand, uniform = cfgs.allocation.values()
    assert eh.replace(name="x", high_heads=rand.high_heads) == rand.replace(name="x")
    # the uniform width of claim (c) has PACE-4/8's payload: 5 + 16/32 + 5/32 = 0.75·(4 + 5/8) + 0.25·(8 + 6/8)
    shape = load_shape()
    assert resident_bits(uniform, shape).payload_bits == resident_bits(eh.replace(high_heads=None), shape).payload_bits
    assert {c.decode_period for c in cfgs.drift.values()} == set(DRIFT_PERIODS)
    pace, rival = cfgs.stepquant.values()  # claim (e): PACE-4 at another dP and group size, against STEPQuant-4
    assert pace.replace(name="x", decode_period=8, group_size=64) == get_config("pace-4").replace(name="x")
    assert rival == get_config("stepquant-4")


@pytest.mark.parametrize("shape", list(BUILTIN_SHAPES))
def test_equal_bits_pace_has_the_most_bits_not_above_the_rival(shape):
    shape = BUILTIN_SHAPES[shape]
    target = resident_bits(get_config("stepquant-4"), shape).resident_bits
    chosen = equal_bits_pace(target, shape)
    # every setting of the family, counted here, and the one of most bits not above the target
    family = {(p, g): resident_bits(get_config("pace-4").replace(decode_period=p, group_size=g), shape).resident_bits
              for p in EQUAL_BITS_PERIODS for g in EQUAL_BITS_GROUPS}
    below = {k: b for k, b in family.items() if b <= target}
    assert below, "a setting of the family fits STEPQuant-4's bits on every published shape"
    p, g = max(below, key=below.get)
    assert (chosen.decode_period, chosen.group_size) == (p, g) and chosen.name == f"pace-4 dP{p} g{g}"
    assert resident_bits(chosen, shape).resident_bits == below[(p, g)] <= target
    fewest = min(family.values())
    assert equal_bits_pace(fewest / 2, shape).decode_period == min(family, key=family.get)[0]  # none fits: the fewest


def test_resamples_are_seeded_draws_of_every_unit():
    counts = resample_counts(7)
    assert counts.shape == (SPREAD_RESAMPLES, 7) and (counts.sum(axis=1) == 7).all()
    assert (resample_counts(7) == counts).all()  # reproducible
    # the same draws made one by one
    draws = np.random.default_rng(SPREAD_SEED).integers(0, 7, size=(SPREAD_RESAMPLES, 7))
    assert all((np.bincount(d, minlength=7) == c).all() for d, c in zip(draws, counts))


def test_spread_interval_share_and_verdict():
    rng = np.random.default_rng(3)
    margins = rng.normal(0.1, 0.1, SPREAD_RESAMPLES)
    sp = spread(margins, margins > 0, "windows", 12)
    assert sp["low"] == pytest.approx(np.sort(margins)[int(0.025 * (SPREAD_RESAMPLES - 1))], abs=0.01)
    assert sp["high"] == pytest.approx(np.sort(margins)[int(0.975 * (SPREAD_RESAMPLES - 1))], abs=0.01)
    assert sp["holds_share"] == np.mean(margins > 0) and sp["n"] == 12
    claim = {"spread": sp}
    assert verdict(claim) == "within the spread"  # mean one standard deviation above 0: ~84% of the resamples
    assert verdict({"spread": {**sp, "holds_share": 0.975}}) == "holds beyond the spread"
    assert verdict({"spread": {**sp, "holds_share": 0.02}}) == "fails beyond the spread"
    assert verdict({}) == "no spread measured"


def _windows(kl: dict[str, list[float]], tokens: list[int]) -> pd.DataFrame:
    return pd.DataFrame([{"config": name, "window": j, "tokens": tokens[j], "kl": v}
                         for name, values in kl.items() for j, v in enumerate(values)])


def test_kl_spread_is_the_margin_of_resampled_windows():
    from pace_core.analysis.claims import _kl_spread

    rng = np.random.default_rng(5)
    tokens = list(rng.integers(50, 300, 9))
    other = rng.random(9) * 1e-3
    # KL half of the other's in every window: every resample has margin 1/2
    exact = _kl_spread(_windows({"a": list(other / 2), "b": list(other)}, tokens), "a", ["b"], {"a": "a", "b": "b"})
    assert exact["low"] == pytest.approx(0.5) and exact["high"] == pytest.approx(0.5) and exact["holds_share"] == 1
    # against the better of two, labels aliased to the configuration names their rows carry: a loop over the draws
    a, c = rng.random(9) * 1e-3, rng.random(9) * 1e-3
    got = _kl_spread(_windows({"A": list(a), "B": list(other), "C": list(c)}, tokens), "x", ["y", "z"],
                     {"x": "A", "y": "B", "z": "C"})
    t = np.array(tokens, dtype=float)
    margins = []
    for d in np.random.default_rng(SPREAD_SEED).integers(0, 9, size=(SPREAD_RESAMPLES, 9)):
        kl = [v[d].sum() / t[d].sum() for v in (a, other, c)]
        margins.append(1 - kl[0] / min(kl[1:]))
    margins = np.array(margins)
    assert got["low"] == pytest.approx(np.quantile(margins, 0.025), rel=1e-9)
    assert got["high"] == pytest.approx(np.quantile(margins, 0.975), rel=1e-9)
    assert got["holds_share"] == np.mean(margins > 0) and got["unit"] == "windows" and got["n"] == 9


def load_shape():
    from pace_core.shapes import BUILTIN_SHAPES

    return BUILTIN_SHAPES["qwen3.5-4b"]


def test_measure_claims_reports_what_it_measured(loaded, text):
    pace48 = calibrate(loaded, get_config("pace-4-8"), text, tokens=64, sample_every=32).config
    calibrated = {n: calibrate(loaded, get_config(n), text, tokens=64, sample_every=32).config
                  for n in ("damp-int4", "damp-int8", "stepquant-4")}
    done = []
    report = measure_claims(loaded, text, pace48, max_tokens=160, window=32, stride=16, batch=4, seeds=3,
                            drift_tokens=192, calibrated=calibrated, progress=done.append)
    n_tokens = tokenize(loaded.tokenizer, read_text(text), 160).shape[1]
    drift_n = drift_sequence(loaded, text, 192).shape[1]
    assert drift_n == 192 > n_tokens  # the drift sequence is read apart from the perplexity's tokens
    # the time-left estimate
    assert sum(done) == claims_progress_total(loaded, pace48, 3, n_tokens, 32, 16, 4, drift_n, calibrated=calibrated)
    claims = {(c["claim"], c["what"]): c for c in report["claims"]}
    assert [c["claim"] for c in report["claims"]] == ["a"] * len(CLAIM_BITS) + ["b", "c", "d", "d", "e"]
    windows = len(range(0, n_tokens - 16, 16))  # windows of 32 every 16 up to the text's end
    for c in claims.values():  # each verdict is the comparison of its own figures
        if c["claim"] in "abe":  # the claimed better one first
            assert c["holds"] == (c["kl"][0] < c["kl"][1]) and c["margin"] == pytest.approx(1 - c["kl"][0] / c["kl"][1])
        if c["claim"] == "c":
            assert c["kl"][1] == min(c["random_kl"]) and len(c["random_kl"]) == 3
            assert c["holds"] == (c["kl"][0] < min(c["kl"][1:]))
            seeds = c["random"]
            assert seeds["kl_mean"] == pytest.approx(np.mean(c["random_kl"]))
            assert seeds["kl_sd"] == pytest.approx(np.std(c["random_kl"], ddof=1))
            assert seeds["below_all"] == (c["kl"][0] < min(c["random_kl"]))
        if c["claim"] == "d":
            e = c["state_error"]
            assert len(e) == len(DRIFT_PERIODS) and c["holds"] == all(b < a for a, b in zip(e, e[1:]))
            assert c["spread"]["unit"] == "decode steps" and c["spread"]["n"] == len(report["common_flush_steps"])
        else:
            assert c["spread"]["unit"] == "windows" and c["spread"]["n"] == windows
        sp = c["spread"]
        assert sp["low"] <= sp["high"] and 0 <= sp["holds_share"] <= 1
    for b in CLAIM_BITS:  # (a): the bits each stores, densely packed (issue 48): b + 1/2 at dP 1, + c · 8 at dP 8
        a = claims[("a", f"{b}-bit RTN (value g32): dP 8 vs dP 1")]
        cfg = get_config("rtn-int4").replace(group_axis="value", group_size=32, bits=b)
        assert a["resident_bits"][1] == resident_bits(cfg, loaded.shape).resident_bits == b + 0.5
        assert a["resident_bits"][0] > a["resident_bits"][1]
    e = claims[next(k for k in claims if k[0] == "e")]
    pace, rival = e["labels"]
    assert rival == "stepquant-4" and e["resident_bits"][0] <= e["resident_bits"][1]
    assert e["resident_bits"][1] == resident_bits(calibrated["stepquant-4"], loaded.shape).resident_bits
    table = claims_table(report)
    assert list(table.columns) == ["claim", "what", "holds", "margin", "low", "high", "verdict"]
    assert list(table.verdict) == [verdict(c) for c in report["claims"]]
    # the figures are the perplexity command's: one configuration scored alone agrees (another batch
    # composition: float32 rounding that can move a 4-bit rounding boundary, so to a small share)
    alone = perplexity(loaded, [get_config("rtn-int8")], text, window=32, stride=16, max_tokens=160,
                       decode_from=16, batch=4).set_index("config")
    main = {r["config"]: r for r in report["main"]}
    assert main["rtn-int8"]["kl"] == pytest.approx(alone.loc["rtn-int8", "kl"], rel=1e-2, abs=1e-6)
    assert main["rtn-int8"]["resident_bits"] == resident_bits(get_config("rtn-int8"), loaded.shape).resident_bits
    assert report["tokens"] == int(alone.loc["rtn-int8", "tokens"])


def test_a_drift_sequence_too_short_for_the_periods_is_refused(loaded, text):
    """Claims (c) and (d) compare the periods at a common decode step: a decoded half shorter than the longest
    period has none (before: a KeyError from the empty table, after the whole perplexity part had run)."""
    least = 2 * max(DRIFT_PERIODS)
    assert drift_sequence(loaded, text, least).shape == (1, least)
    with pytest.raises(PaceError, match=rf"drift tokens: {least - 1} not allowed .*allowed: at least {least}"):
        drift_sequence(loaded, text, least - 1)
