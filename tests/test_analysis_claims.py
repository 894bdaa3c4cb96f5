import pytest
import torch

from pace_core.accounting import resident_bits
from pace_core.analysis.calibration import calibrate
from pace_core.analysis.claims import (CLAIM_BITS, DRIFT_PERIODS, claim_configs, claims_progress_total, claims_table,
                                       measure_claims, random_allocations)
from pace_core.analysis.quality import perplexity
from pace_core.analysis.text import read_text, tokenize
from pace_core.config import get_config
from pace_core.model.loading import load_model

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
    cfgs = claim_configs(pace48, [((2,), (3,))])
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


def load_shape():
    from pace_core.shapes import BUILTIN_SHAPES

    return BUILTIN_SHAPES["qwen3.5-4b"]


def test_measure_claims_reports_what_it_measured(loaded, text):
    pace48 = calibrate(loaded, get_config("pace-4-8"), text, tokens=64, sample_every=32).config
    calibrated = {n: calibrate(loaded, get_config(n), text, tokens=64, sample_every=32).config
                  for n in ("damp-int4", "damp-int8")}
    done = []
    report = measure_claims(loaded, text, pace48, max_tokens=160, window=32, stride=16, batch=4, seeds=3,
                            drift_tokens=64, calibrated=calibrated, progress=done.append)
    n_tokens = tokenize(loaded.tokenizer, read_text(text), 160).shape[1]
    assert sum(done) == claims_progress_total(loaded, pace48, 3, n_tokens, 32, 16, 4, 64)  # the time-left estimate
    claims = {(c["claim"], c["what"]): c for c in report["claims"]}
    assert [c["claim"] for c in report["claims"]] == ["a"] * len(CLAIM_BITS) + ["b", "c", "d", "d"]
    for c in claims.values():  # each verdict is the comparison of its own figures
        if c["claim"] in "ab":  # the claimed better one first
            assert c["holds"] == (c["kl"][0] < c["kl"][1]) and c["margin"] == pytest.approx(1 - c["kl"][0] / c["kl"][1])
        if c["claim"] == "c":
            assert c["kl"][1] == min(c["random_kl"]) and len(c["random_kl"]) == 3
            assert c["holds"] == (c["kl"][0] < min(c["kl"][1:]))
        if c["claim"] == "d":
            e = c["state_error"]
            assert len(e) == len(DRIFT_PERIODS) and c["holds"] == all(b < a for a, b in zip(e, e[1:]))
    assert list(claims_table(report).columns) == ["claim", "what", "holds", "margin"]
    # the figures are the perplexity command's: one configuration scored alone agrees (another batch
    # composition: float32 rounding that can move a 4-bit rounding boundary, so to a small share)
    alone = perplexity(loaded, [get_config("rtn-int8")], text, window=32, stride=16, max_tokens=160,
                       decode_from=16, batch=4).set_index("config")
    main = {r["config"]: r for r in report["main"]}
    assert main["rtn-int8"]["kl"] == pytest.approx(alone.loc["rtn-int8", "kl"], rel=1e-2, abs=1e-6)
    assert main["rtn-int8"]["resident_bits"] == resident_bits(get_config("rtn-int8"), loaded.shape).resident_bits
    assert report["tokens"] == int(alone.loc["rtn-int8", "tokens"])
