import math

import pytest
import torch

from pace_core.analysis.drift import drift, relative_errors, token_nll
from pace_core.config import PaceConfig, get_config
from pace_core.errors import PaceError
from pace_core.model.loading import load_model
from pace_core.model.patch import gdn_modules

pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    m = load_model(tiny_checkpoints["qwen3_5_text"])
    with torch.no_grad():  # long memories: decays exp(g) close to 1
        for _, mod in gdn_modules(m.model):
            mod.A_log.fill_(math.log(0.02))
            mod.dt_bias.fill_(-4.0)
    return m


def test_relative_errors_against_float64():
    ref = {0: torch.randn(1, 2, 4, 4), 3: torch.randn(1, 2, 4, 4)}
    noisy = {k: v + 0.1 * torch.randn_like(v) for k, v in ref.items()}
    per, pooled = relative_errors(noisy, ref)
    for k in ref:
        want = torch.linalg.norm(noisy[k].double() - ref[k].double()) / torch.linalg.norm(ref[k].double())
        assert per[k] == pytest.approx(float(want), rel=1e-12)
    num = sum(float(((noisy[k].double() - ref[k].double()) ** 2).sum()) for k in ref)
    den = sum(float((ref[k].double() ** 2).sum()) for k in ref)
    assert pooled == pytest.approx(math.sqrt(num / den), rel=1e-12)


def test_token_nll():
    logits = torch.randn(1, 5, 7)
    ids = torch.randint(0, 7, (1, 5))
    want = torch.nn.functional.cross_entropy(logits[0, :-1].double(), ids[0, 1:], reduction="none")
    torch.testing.assert_close(token_nll(logits, ids), want)


def test_drift_zero_for_fp32_and_larger_at_dp1(loaded):
    ids = torch.randint(3, 100, (1, 72))
    base = PaceConfig(name="b", method="pace", bits=4, group_axis="key", group_size=64, buffer="fp32")
    cfgs = [get_config("fp32"), base.replace(name="dP1", decode_period=1), base.replace(name="dP8", decode_period=8)]
    res = drift(loaded, cfgs, ids, decode_from=24, every=4)
    t = res.table
    assert sorted(t.step.unique()) == list(range(0, 48, 4)) + [47]
    fp = t[t.config == "fp32"]
    assert (fp.rel_error == 0).all() and (fp.excess_nll == 0).all()
    s = res.summary.set_index("config")
    assert s.loc["dP1", "mean_rel_error"] > s.loc["dP8", "mean_rel_error"] > 0
    assert s.loc["dP1", "final_rel_error"] > s.loc["dP8", "final_rel_error"] > 0
    assert s.loc["dP1", "decode_steps"] == 48
    # per-layer table: one row per GDN layer and captured step
    lt = res.layer_table
    assert set(lt.layer) == set(loaded.gdn_layers)
    assert len(lt[lt.config == "dP8"]) == len(loaded.gdn_layers) * len(fp)


def test_drift_bad_input(loaded):
    ids = torch.randint(3, 100, (1, 10))
    with pytest.raises(PaceError, match="decode_from"):
        drift(loaded, [get_config("rtn-int4")], ids, decode_from=9)
    with pytest.raises(PaceError, match="every"):
        drift(loaded, [get_config("rtn-int4")], ids, decode_from=4, every=0)


def test_drift_damp_rows_list_or_mapping(loaded):
    from pace_core.analysis.calibration import calibrate

    ids = torch.randint(3, 100, (1, 20))
    cfg = get_config("damp-int4").replace(damp_outlier_rows=4)
    rows = calibrate(loaded, cfg, tokens=32, sample_every=16).damp_rows
    a = drift(loaded, [cfg], ids, decode_from=12, damp_rows=rows).summary
    b = drift(loaded, [cfg], ids, decode_from=12, damp_rows={cfg.name: rows}).summary
    assert a.mean_rel_error[0] == b.mean_rel_error[0] > 0
    with pytest.raises(PaceError, match="damp_rows"):
        drift(loaded, [cfg], ids, decode_from=12)
