import pandas as pd
import pytest
import torch
from numerics import fp32_bound

from pace_core.analysis.generation import first_divergence, generate_side_by_side
from pace_core.config import get_config
from pace_core.errors import PaceError
from pace_core.methods import Calibrated
from pace_core.model.loading import load_model

pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return load_model(tiny_checkpoints["qwen3_5_text"])


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2
    assert first_divergence([], []) is None


def test_side_by_side(loaded):
    cfgs = [get_config("fp32"), get_config("rtn-int2")]
    t = generate_side_by_side(loaded, cfgs, "The cat sat", max_new_tokens=12, seed=3)
    assert list(zip(t["mode"], t["config"])) == [("greedy", "fp32"), ("greedy", "rtn-int2"),
                                                  ("sampled", "fp32"), ("sampled", "rtn-int2")]
    ids = loaded.tokenizer("The cat sat", return_tensors="pt", add_special_tokens=False)["input_ids"]
    greedy = t.iloc[0]
    assert greedy.first_divergence is pd.NA and greedy.ref_agreement == 1.0
    # independent reference: one full forward over prompt + continuation. Each generated token is its top-1,
    # up to a near tie that float32 rounding can swap (generate's cached steps are another summation order:
    # the tiny model's longest chain is ~2·10^4 float32 operations, so logits agree to fp32_bound(2e4) of
    # their magnitude).
    seq = torch.cat([ids, torch.tensor([greedy.tokens])], dim=1)
    with torch.no_grad():
        logits = loaded.model(seq).logits[0, ids.shape[1] - 1:-1].double()
    tie = 2 * fp32_bound(20_000) * float(logits.abs().max())
    chosen = logits.gather(1, torch.tensor(greedy.tokens)[:, None])[:, 0]
    assert (logits.max(-1).values - chosen <= tie).all()
    # NLL of the reference's own greedy text under the reference, recomputed from that forward
    want = float(-torch.log_softmax(logits, -1).gather(1, seq[0, ids.shape[1]:, None]).mean())
    assert greedy.ref_nll == pytest.approx(want, rel=1e-6)
    assert "".join(greedy.pieces) == greedy.text
    # seeded sampling is reproducible
    again = generate_side_by_side(loaded, [get_config("fp32")], "The cat sat", max_new_tokens=12, seed=3,
                                  modes=["sampled"])
    assert again.iloc[0].tokens == t.iloc[2].tokens
    # int2 state diverges or agrees; its divergence index is consistent with the tokens
    q = t.iloc[1]
    d = first_divergence(greedy.tokens, q.tokens)
    assert (d is None and q.first_divergence is pd.NA) or q.first_divergence == d


def test_kept_reference_rows(loaded):
    """The reference rows of an earlier call are reused: only the configurations are generated, and their
    first divergence is counted against the kept reference continuation."""
    first = generate_side_by_side(loaded, [get_config("fp32")], "The cat sat", max_new_tokens=8, seed=5)
    more = generate_side_by_side(loaded, [get_config("rtn-int2")], "The cat sat", max_new_tokens=8, seed=5,
                                 reference_rows=first)
    assert list(zip(more["mode"], more["config"])) == [("greedy", "rtn-int2"), ("sampled", "rtn-int2")]
    for mode in ("greedy", "sampled"):
        ref = first[first["mode"] == mode].iloc[0].tokens
        row = more[more["mode"] == mode].iloc[0]
        d = first_divergence(ref, row.tokens)
        assert (d is None and row.first_divergence is pd.NA) or row.first_divergence == d
    with pytest.raises(PaceError, match="reference_rows"):
        generate_side_by_side(loaded, [get_config("rtn-int2")], "The cat sat", max_new_tokens=8, modes=["greedy"],
                              reference_rows=first)


def test_bad_input(loaded):
    with pytest.raises(PaceError, match="prompt"):
        generate_side_by_side(loaded, [get_config("fp32")], "")
    with pytest.raises(PaceError, match="modes"):
        generate_side_by_side(loaded, [get_config("fp32")], "x", modes=["beam"])
    with pytest.raises(PaceError, match="max_new_tokens"):
        generate_side_by_side(loaded, [get_config("fp32")], "x", max_new_tokens=0)


def test_damp_side_by_side_uses_the_given_outlier_rows(loaded):
    from pace_core.model.patch import pace

    cfg = get_config("damp-int4")
    shape = loaded.shape
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    rows = [torch.stack([torch.randperm(shape.d_k, generator=gen)[:cfg.damp_outlier_rows].sort().values
                         for _ in range(shape.num_v_heads)]) for _ in range(shape.num_gdn_layers)]
    # the reference generated apart, so the damp row runs alone in its batch: the same code as pace() below
    ref = generate_side_by_side(loaded, [], "The cat sat", max_new_tokens=10, modes=["greedy"])
    calibrated = cfg.replace(calibrated=Calibrated([{"rows": r.to(torch.int16)} for r in rows]))
    t = generate_side_by_side(loaded, {"damp": calibrated}, "The cat sat", max_new_tokens=10, modes=["greedy"],
                              reference_rows=ref)
    ids = loaded.tokenizer("The cat sat", return_tensors="pt", add_special_tokens=False)["input_ids"]
    with pace(loaded.model, calibrated), torch.no_grad():
        out = loaded.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                                    do_sample=False, pad_token_id=loaded.tokenizer.pad_token_id)
    assert list(t["config"]) == ["damp"]
    assert t.iloc[0].tokens == out[0, ids.shape[1]:].tolist()
    with pytest.raises(PaceError, match="not calibrated"):
        generate_side_by_side(loaded, {"damp": cfg}, "The cat sat", max_new_tokens=4, modes=["greedy"])
