import pandas as pd
import pytest
import torch

from pace_core.analysis.generation import first_divergence, generate_side_by_side
from pace_core.config import get_config
from pace_core.errors import PaceError
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
    # independent greedy reference: argmax loop over full forwards
    seq = ids
    with torch.no_grad():
        for _ in range(12):
            nxt = loaded.model(seq).logits[0, -1].argmax()
            seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
            if nxt == loaded.tokenizer.eos_token_id:
                break
    greedy = t.iloc[0]
    assert greedy.tokens == seq[0, ids.shape[1]:].tolist()
    assert greedy.first_divergence is pd.NA
    assert greedy.ref_agreement == 1.0
    # NLL of the reference's own greedy text under the reference, recomputed
    with torch.no_grad():
        logp = torch.log_softmax(loaded.model(seq).logits[0, ids.shape[1] - 1 : -1].double(), -1)
    want = float(-logp.gather(1, seq[0, ids.shape[1]:, None]).mean())
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
    t = generate_side_by_side(loaded, {"damp": cfg}, "The cat sat", max_new_tokens=10, modes=["greedy"],
                              damp_rows={"damp": rows})
    ids = loaded.tokenizer("The cat sat", return_tensors="pt", add_special_tokens=False)["input_ids"]
    with pace(loaded.model, cfg, damp_rows=rows), torch.no_grad():
        out = loaded.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                                    do_sample=False, pad_token_id=loaded.tokenizer.pad_token_id)
    assert list(t["config"]) == ["fp32", "damp"]
    assert t.iloc[1].tokens == out[0, ids.shape[1]:].tolist()
    with pytest.raises(PaceError, match="damp_rows"):
        generate_side_by_side(loaded, {"damp": cfg}, "The cat sat", max_new_tokens=4, modes=["greedy"])
