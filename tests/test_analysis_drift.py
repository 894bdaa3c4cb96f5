import math

import pytest
import torch
from numerics import fp32_bound

from pace_core.analysis.drift import drift, drift_reference
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


def test_drift_zero_for_fp32_and_larger_at_dp1(loaded):
    ids = torch.randint(3, 100, (1, 72))
    base = PaceConfig(name="b", method="pace", bits=4, group_axis="key", group_size=64, buffer="fp32")
    cfgs = [get_config("fp32"), base.replace(name="dP1", decode_period=1), base.replace(name="dP8", decode_period=8)]
    res = drift(loaded, cfgs, ids, decode_from=24, every=4)
    t = res.table
    assert sorted(t.step.unique()) == list(range(0, 48, 4)) + [47]
    fp = t[t.config == "fp32"]  # the reference's own function, in another row of the batch: float32 rounding
    tol = fp32_bound(4 * (64 + 72 * 64 + 4 * 32 + 64 + 96) + 64)
    assert (fp.rel_error <= tol).all() and (fp.excess_nll.abs() <= tol * 10).all()
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


def test_drift_of_damp_runs_its_calibrated_rows(loaded):
    from pace_core.analysis.calibration import calibrate

    ids = torch.randint(3, 100, (1, 20))
    cfg = get_config("damp-int4").replace(damp_outlier_rows=4)
    calibrated = calibrate(loaded, cfg, tokens=32, sample_every=16).config
    a = drift(loaded, [calibrated], ids, decode_from=12).summary
    b = drift(loaded, [cfg.replace(calibrated=calibrated.calibrated)], ids, decode_from=12).summary
    assert a.mean_rel_error[0] == b.mean_rel_error[0] > 0
    with pytest.raises(PaceError, match="not calibrated on the model"):
        drift(loaded, [cfg], ids, decode_from=12)


def test_drift_against_a_kept_reference(loaded):
    """A reference run kept from drift_reference scores configurations as the in-batch reference does: the
    same function, in a batch of another size (float32 rounding of the reference; it can move a rounding
    boundary of a quantised state, so the quantised rows agree to a share of a 4-bit step, not to fp32)."""
    ids = torch.randint(3, 100, (1, 48))
    cfgs = [get_config("fp32"), get_config("rtn-int4"), get_config("pace-4").replace(prefill_period=16)]
    together = drift(loaded, cfgs, ids, decode_from=16, every=4)
    kept = drift_reference(loaded, ids, 16, every=4)
    assert len(kept.states) == len(loaded.gdn_layers) * len(kept.steps) and kept.nll.shape == (32,)
    apart = drift(loaded, cfgs[1:], ids, decode_from=16, every=4, reference=kept)
    a = together.summary.set_index("config").loc[["rtn-int4", "pace-4"]]
    b = apart.summary.set_index("config")
    assert b.mean_rel_error.to_numpy() == pytest.approx(a.mean_rel_error.to_numpy(), rel=1e-2)
    assert b.mean_excess_nll.to_numpy() == pytest.approx(a.mean_excess_nll.to_numpy(), rel=1e-2, abs=1e-4)
    assert (b.mean_rel_error > 0.01).all()
    with pytest.raises(PaceError, match="reference"):
        drift(loaded, cfgs[1:], ids, decode_from=16, every=2, reference=kept)
