import copy
import hashlib
import io
import json
import math
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from pace_core import result_checks as C
from pace_core import results as R
from pace_core.cli import main
from pace_core.config import get_config
from pace_core.errors import PaceError


@pytest.fixture(scope="module")
def correct_drift(tmp_path_factory):
    """A correct drift of bf16 and rtn-int8 on the embedded model, 64 tokens of the calibration text (the CLI's
    own command)."""
    out = tmp_path_factory.mktemp("drift")
    argv = ["drift", "--configs", "bf16", "rtn-int8", "--tokens", "64", "--out", str(out), "--quiet"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", [str(Path(R.__file__).parent / "__main__.py"), *argv])  # `python -m pace_core`
        assert main(argv) == 0
    [folder] = [p for p in out.iterdir() if p.is_dir()]
    return folder


def _groups(rng: np.random.Generator, g: int) -> dict[str, np.ndarray]:
    n = 4096
    return {"normal": rng.standard_normal((n, g)), "laplace": rng.laplace(size=(n, g)),
            "student t (2)": rng.standard_t(2, size=(n, g)), "one spike": np.eye(g)[rng.integers(0, g, n)] * 50
            + rng.standard_normal((n, g)) * 0.01}


@pytest.mark.parametrize("bits, g", [(8, 32), (8, 256), (8, 64)])
def test_one_rounding_stays_within_the_per_rounding_bound(bits, g):
    """The bound's per-rounding term r = sqrt(g) / ((2^(b-1) - 1) sqrt(12)), checked against b-bit symmetric
    round to nearest written here (numpy), on groups of several distributions: the RMS relative error of
    every distribution is below r."""
    rng = np.random.default_rng(8)
    cfg = get_config("rtn-int8").replace(group_size=g) if g <= 128 else get_config("rtn-int8")
    r = (C.state_error_bound(cfg, 1) / C.PROPAGATION if g <= 128 else
         math.sqrt(C.RECORD_ENTRIES) / ((2 ** (bits - 1) - 1) * math.sqrt(12)))
    assert r == pytest.approx(math.sqrt(g) / (127 * math.sqrt(12)), rel=1e-12)
    for name, x in _groups(rng, g).items():
        step = np.abs(x).max(axis=1, keepdims=True) / (2 ** (bits - 1) - 1)
        err = np.round(x / step) * step - x
        rel = math.sqrt((err ** 2).sum() / (x ** 2).sum())
        assert rel <= r, f"{name}: {rel} > {r}"


def test_one_bfloat16_rounding_stays_within_its_bound():
    rng = np.random.default_rng(9)
    x = torch.tensor(rng.standard_normal(1 << 16) * np.exp(rng.uniform(-20, 20, 1 << 16)))
    rel = ((x.to(torch.bfloat16).double() - x) / x).pow(2).mean().sqrt().item()
    assert rel <= C.BF16_ROUNDING == C.state_error_bound(get_config("bf16"), 1) / C.PROPAGATION
    assert C.BF16_ROUNDING == pytest.approx(2 ** -9, rel=0.2)  # about 2^-9, as the docs say


def test_the_bound_grows_as_a_random_walk_and_exists_only_where_derived():
    r8 = C.state_error_bound(get_config("rtn-int8"), 1)
    assert r8 == pytest.approx(C.PROPAGATION * math.sqrt(32) / (127 * math.sqrt(12)), rel=1e-12)
    assert C.state_error_bound(get_config("rtn-int8"), 400) == pytest.approx(20 * r8, rel=1e-12)
    assert C.state_error_bound(get_config("fp32"), 100) == pytest.approx(C.PROPAGATION * 10 * 2 ** -20, rel=1e-12)
    assert C.state_error_bound(get_config("damp-int8"), 1) == pytest.approx(r8, rel=1e-12)  # groups of 32 too
    buffered = get_config("pace-4").replace(bits=8, group_size=32)  # dP 8: int8 records of up to 256 entries
    assert C.state_error_bound(buffered, 1) == pytest.approx(C.PROPAGATION * 16 / (127 * math.sqrt(12)), rel=1e-12)
    for name in ("rtn-int4", "pace-4", "pace-4-8", "qmamba-dsq", "damp-int4"):
        assert C.state_error_bound(get_config(name), 100) is None
    assert C.state_error_bound(get_config("pace-4-8").replace(bits=8), 100) is None  # 4-bit buffer keys


def test_the_bound_under_the_combinations():
    """The key rotation keeps the bound, stochastic rounding widens it by sqrt(3) (checked as above: one stochastic
    rounding, floor(x / step + u), of every distribution's groups stays within r sqrt(3)), static scales have
    none."""
    rtn8 = get_config("rtn-int8")
    r8 = C.state_error_bound(rtn8, 1)
    assert C.state_error_bound(rtn8.replace(key_hadamard=True), 1) == r8
    assert C.state_error_bound(rtn8.replace(rounding="stochastic"), 1) == pytest.approx(math.sqrt(3) * r8, rel=1e-12)
    assert C.state_error_bound(rtn8.replace(scales="static"), 1) is None
    rng = np.random.default_rng(10)
    for name, x in _groups(rng, 32).items():
        step = np.abs(x).max(axis=1, keepdims=True) / 127
        err = np.floor(x / step + rng.uniform(size=x.shape)) * step - x
        rel = math.sqrt((err ** 2).sum() / (x ** 2).sum())
        assert rel <= math.sqrt(3) * r8 / C.PROPAGATION, f"{name}: {rel}"


def test_a_correct_drift_passes_and_the_shipped_error_in_it_is_refused(correct_drift, tmp_path):
    """The drift of bf16 and rtn-int8 that the CLI makes now reads below its bound (0.1 to 0.15 of it here);
    the same file with the shipped results' error (every step 1.21) is refused, naming the file and the bound."""
    listing = R.list_results(correct_drift.name, "drift", root=correct_drift.parent)
    assert listing.damaged == [] and sorted(r.data["config"] for r in listing.results) == ["bf16", "rtn-int8"]
    for r in listing.results:
        decoded = r.data["tokens"] - r.data["decode_from"]
        bound = C.state_error_bound(get_config(r.data["config"]), decoded + 1)
        assert 0 < r.table.rel_error.median() < bound
    [bf16] = [r for r in listing.results if r.data["config"] == "bf16"]
    folder = tmp_path / correct_drift.name
    shutil.copytree(correct_drift, folder)
    _rewrite_table(folder / bf16.path.name, bf16.table.assign(rel_error=1.21))
    [damaged] = R.list_results(folder.name, "drift", root=tmp_path).damaged
    assert damaged.path == folder / bf16.path.name
    assert "bf16's median relative state error is 1.21; allowed for none bfloat16 over 33 roundings" in damaged.reason
    assert damaged.command.startswith("python -m pace_core drift --configs bf16 rtn-int8")


def _rewrite_table(path, table: pd.DataFrame) -> None:
    """Replace a stored result's table as a writer would (new content-addressed file, JSON naming it)."""
    buf = io.BytesIO()
    table.to_parquet(buf, index=False)
    sha = hashlib.sha256(buf.getvalue()).hexdigest()
    doc = json.loads(path.read_text())
    doc["table"] = {"file": f"{path.stem}.{sha[:8]}.parquet", "sha256": sha}
    (path.parent / doc["table"]["file"]).write_bytes(buf.getvalue())
    path.write_text(json.dumps(doc))


def test_a_drift_missing_a_field_its_page_needs_is_damaged(correct_drift, tmp_path):
    folder = tmp_path / correct_drift.name
    shutil.copytree(correct_drift, folder)
    [path] = [p for p in folder.glob("drift-*.json") if json.loads(p.read_text())["data"]["config"] == "rtn-int8"]
    doc = json.loads(path.read_text())
    del doc["data"]["summary"]["final_rel_error"]
    path.write_text(json.dumps(doc))
    listing = R.list_results(folder.name, "drift", root=tmp_path)
    assert [r.data["config"] for r in listing.results] == ["bf16"]
    assert [(d.path, d.reason) for d in listing.damaged] == [
        (path, "refused by its sanity check: the summary lacks the field final_rel_error")]


ROW = {"config": "rtn-int8", "tokens": 99, "nll": 3.0, "ppl": math.exp(3.0), "agreement": 0.99, "kl": 1e-5, "bpb": 1.2}


def _generation() -> pd.DataFrame:
    return pd.DataFrame({"mode": ["greedy"] * 2, "config": ["fp32", "rtn-int4"], "tokens": [[1, 2, 3], [1, 2, 4]],
                         "pieces": [["a", "b", "c"], ["a", "b", "d"]], "text": ["abc", "abd"],
                         "first_divergence": pd.array([None, 2], dtype="Int64"), "ref_nll": [1.5, 2.5],
                         "ref_agreement": [1.0, 2 / 3]})


def _structure() -> pd.DataFrame:
    return pd.DataFrame({"layer": [0], "head": [0], "col_rms_max": [2.0], "col_rms_median": [1.0], "col_ratio": [2.0],
                         "row_rms_max": [3.0], "row_rms_median": [1.5], "row_ratio": [2.0], "outlier_cols": [0]})


def _sweep(bits: int, error: float) -> pd.DataFrame:
    return pd.DataFrame({"config": [f"b{bits}"], "bits": [bits], "decode_period": [1], "group_axis": ["key"],
                         "group_size": [32], "buffer": ["int8"], "resident_bits": [bits + 0.5],
                         "prefill_rel_error": [error], "final_rel_error": [error], "mean_rel_error": [error],
                         "output_rel_error": [error]})


def _calibration() -> dict:
    from pace_core.analysis.calibration import Calibration

    a = torch.tensor([[0.5, 0.9]], dtype=torch.float64)
    e = torch.tensor([[1e-3, 2e-3]], dtype=torch.float64)
    return Calibration(get_config("rtn-int4"), [0], a, e, e / (1 - a ** 2), 64, 4).to_data()


CLAIMS = {"claims": [{"claim": "a", "what": "x", "labels": ["p", "q"], "holds": True, "margin": 0.5,
                      "kl": [1e-3, 2e-3]},
                     {"claim": "d", "what": "y", "labels": ["p"], "holds": True, "margin": 0.1, "state_error": [0.2]}],
          "main": [{"config": "pace-4", "resident_bits": 5.03, "resident_bits_27b": 4.9, "bpb": 1.6, "kl": 2e-4,
                    "agreement": 0.99}], "tokens": 99, "drift_tokens": 64}
CLAIMS_TABLE = pd.DataFrame({"claim": ["a", "d"], "what": ["x", "y"], "holds": [True, True], "margin": [0.5, 0.1]})
SPREAD = {"unit": "windows", "n": 7, "low": 0.1, "high": 0.8, "holds_share": 0.99}
WITH_SPREAD = {**CLAIMS, "claims": [{**c, "spread": dict(SPREAD)} for c in CLAIMS["claims"]]}


def _windows(row: dict) -> pd.DataFrame:
    """The per-window sums of ``row`` over three windows of 33 tokens (its 99)."""
    share = np.array([0.2, 0.5, 0.3])
    return pd.DataFrame({"config": row["config"], "window": [0, 1, 2], "begin": [0, 32, 64], "end": [64, 96, 128],
                         "tokens": [33, 33, 33], "nll": share * row["nll"] * 99, "agreed": [33, 32, 33],
                         "kl": share * row["kl"] * 99})


def _compare() -> dict:
    from pace_core.analysis.compare import comparison, point
    from pace_core.shapes import BUILTIN_SHAPES

    shape = BUILTIN_SHAPES["qwen3.5-4b"]
    rows = {"fp32": (0.0, 1.0), "rtn-int4": (3e-3, 0.95), "pace-4": (1e-3, 0.97), "rtn-int8": (2e-3, 0.99)}
    data, _ = comparison([point(get_config(n), shape, {"kl": kl, "agreement": a, "bpb": 1.5, "ppl": 12.0, "tokens": 99})
                          for n, (kl, a) in rows.items()])
    return {**data, "tokens": 99}


COMPARE = _compare()
COMPARE_TABLE = pd.DataFrame({"config": ["rtn-int4"], "resident_bits": [4.5], "kl": [3e-3], "agreement": [0.95],
                              "bpb": [1.5], "frontier": [True]})

# kind, a valid (data, table), a change that breaks it, what the refusal says
CASES = [
    (
        "perplexity",
        {"config": "rtn-int8", "row": ROW, "decode_from": 1},
        None,
        lambda d, t: d["row"].update(kl=-1e-9),
        "rtn-int8's KL is -1e-09; allowed: finite, >= 0",
    ),
    (
        "perplexity",
        {"config": "rtn-int8", "row": ROW, "decode_from": 1},
        None,
        lambda d, t: d["row"].update(nll=0.0, ppl=1.0),
        "rtn-int8's perplexity is 1.0; allowed: finite, > 1",
    ),
    (
        "perplexity",
        {"config": "rtn-int8", "row": ROW, "decode_from": 1},
        None,
        lambda d, t: d["row"].pop("bpb"),
        "the row lacks the field bpb",
    ),
    (
        "perplexity",
        {"config": "fp32", "row": {**ROW, "config": "fp32", "agreement": 1.0, "kl": 0.0}, "decode_from": 1},
        None,
        lambda d, t: d["row"].update(agreement=0.999),
        "the reference fp32 has KL 0.0 and agreement 0.999",
    ),
    (
        "claims_quality",
        {"config": "rtn-int8", "row": ROW, "decode_from": 1},
        None,
        lambda d, t: d["row"].update(agreement=1.5),
        "rtn-int8's top-1 agreement is 1.5",
    ),
    (
        "generation",
        {"config": "fp32", "prompt": "p"},
        _generation(),
        lambda d, t: t.__setitem__("first_divergence", pd.array([1, 2], dtype="Int64")),
        "the reference fp32 diverges from itself at token 1",
    ),
    (
        "generation",
        {"config": "fp32", "prompt": "p"},
        _generation(),
        lambda d, t: t.__setitem__("ref_nll", [float("nan"), 1.0]),
        "NLL under the reference is nan",
    ),
    (
        "structure",
        {"tokens": 9, "threshold": 4.0, "summary": []},
        _structure(),
        lambda d, t: t.__setitem__("col_ratio", [0.5]),
        "a ratio of the largest to the median RMS is 0.5",
    ),
    (
        "sweep",
        {"steps": {}, "tokens": 64, "decode_tokens": 15, "mode": "layer-local"},
        _sweep(8, 0.01),
        lambda d, t: t.__setitem__("mean_rel_error", [0.3]),
        "b8's median relative state error is 0.3",
    ),
    (
        "calibration",
        _calibration(),
        pd.DataFrame(columns=["layer", "gdn_index", "head", "a", "e", "E", "high"]),
        lambda d, t: d["a"][0].__setitem__(1, 1.5),
        "a head's decay a_h is 1.5",
    ),
    ("claims", CLAIMS, CLAIMS_TABLE, lambda d, t: d["main"][0].update(kl=float("inf")), "pace-4's KL is inf"),
    (
        "claims",
        CLAIMS,
        CLAIMS_TABLE,
        lambda d, t: d["claims"][1].pop("state_error"),
        "a claim without KL lacks the field state_error",
    ),
    (
        "perplexity",
        {"config": "rtn-int8", "row": ROW, "decode_from": 1},
        _windows(ROW),
        lambda d, t: t.__setitem__("kl", t["kl"] * 1.01),
        "rtn-int8: its windows' kl adds up to",
    ),
    (
        "claims_quality",
        {"config": "rtn-int8", "row": ROW, "decode_from": 1},
        _windows(ROW),
        lambda d, t: t.__setitem__("tokens", [33, 33, 34]),
        "rtn-int8: its windows score 100 tokens, its row 99",
    ),
    (
        "perplexity",
        {"config": "rtn-int8", "row": ROW, "decode_from": 1},
        _windows(ROW),
        lambda d, t: t.__setitem__("agreed", [33, 34, 33]),
        "rtn-int8: a window has more agreeing tokens than scored",
    ),
    (
        "perplexity",
        {"config": "fp32", "row": {**ROW, "config": "fp32", "agreement": 1.0, "kl": 0.0}, "decode_from": 1},
        _windows({**ROW, "config": "fp32", "kl": 0.0}).assign(agreed=33),
        lambda d, t: t.__setitem__("agreed", [33, 33, 32]),
        "the reference fp32 differs from itself in a window",
    ),
    (
        "claims",
        WITH_SPREAD,
        CLAIMS_TABLE,
        lambda d, t: d["claims"][0]["spread"].update(low=0.9),
        "claim a's margin interval [0.9, 0.8] is not in order",
    ),
    (
        "claims",
        WITH_SPREAD,
        CLAIMS_TABLE,
        lambda d, t: d["claims"][1]["spread"].update(holds_share=1.2),
        "claim d's share of resamples is 1.2",
    ),
    (
        "compare",
        COMPARE,
        COMPARE_TABLE,
        lambda d, t: d["frontier"].append("rtn-int8"),
        "is not its points' Pareto frontier ['rtn-int4', 'pace-4', 'fp32']",
    ),
    ("compare", COMPARE, COMPARE_TABLE, lambda d, t: d["points"][2].update(kl=-1.0), "pace-4's KL is -1.0"),
    (
        "compare",
        COMPARE,
        COMPARE_TABLE,
        lambda d, t: d["points"][0].update(kl=1e-4),
        "the reference fp32 has KL 0.0001 to itself",
    ),
]


@pytest.mark.parametrize("kind, data, table, breaks, message", CASES,
                         ids=[f"{c[0]}: {c[4][:30]}" for c in CASES])
def test_each_kind_is_checked(tmp_path, kind, data, table, breaks, message):
    """A valid result of each kind is stored and read; the same with one wrong number or a missing field is
    refused when stored and reported as damaged when read."""
    key = R.result_key({"kind": kind, "message": message})
    prov = R.make_provenance("m", command=f"python -m pace_core {kind}")
    R.save_result(kind, "m", key, copy.deepcopy(data), prov, None if table is None else table.copy(), root=tmp_path)
    assert R.load_result(kind, "m", key, root=tmp_path).data == json.loads(json.dumps(data))
    bad, bad_table = copy.deepcopy(data), None if table is None else table.copy()
    breaks(bad, bad_table)
    with pytest.raises(PaceError, match="not stored: .*" + re.escape(message)):
        R.save_result(kind, "m", key, bad, prov, bad_table, root=tmp_path)
    path = tmp_path / "m" / f"{kind}-{key}.json"
    doc = json.loads(path.read_text())
    doc["data"] = bad
    path.write_text(json.dumps(doc))
    if bad_table is not None:
        _rewrite_table(path, bad_table)
    with pytest.raises(R.DamagedResult, match=re.escape(message)):
        R.load_result(kind, "m", key, root=tmp_path)
