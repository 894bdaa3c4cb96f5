"""GPU results = CPU results: every analysis run through the Triton kernels (pace_core.backend's ``triton``
setting: interpreted on CPU tensors here, compiled on CUDA in the GPU check) against the same analysis on the
PyTorch reference, on the embedded model.

On the CPU the text is short (the interpreter runs each kernel program in numpy); with
``PACE_KERNEL_TESTS=cuda`` the same comparisons run on the GPU over longer texts and more configurations.

Tolerances, from what the two backends compute differently:

- unrounded arithmetic (fp32 reference states, structure statistics, calibration decays) differs only by
  summation order: :func:`numerics.fp32_bound` of the longest dependent chain;
- a rounding to few bits after two such paths can put a value on the other side of a rounding boundary where it
  lies within float32 rounding of it: one code step in one entry. The delta rule spreads that step over the
  state's row and column at the next token, where more entries then lie near a boundary, so after the first such
  flip the two paths round independently: two realisations of one rounding process, whose per-step state errors
  and excess NLLs differ by the rounding noise itself (measured on an H100 over 256 decode steps: up to 2.4 % of
  bf16's state error per step, 0.17 nats of RTN-INT4's NLL at one step, while their means agree to 0.2 % and
  5.5e-4 nats). Drift therefore compares each configuration's means over the decode steps, to
  :func:`numerics.mean_difference_bound` (4 standard errors of the mean difference, from block means) plus
  :data:`FP32_SHARE` of the mean for the float32 differences the paths share from the start;
- a log-probability moves with the state it reads: means of per-token NLLs over windows (log perplexity, KL)
  agree to :data:`NLL_ABS` nats (those windows are short: measured up to 2e-4);
- greedy generations: the first step's logits read the prompt's state, computed alike by both paths, so they agree
  to float32 rounding (:data:`FP32_SHARE`); later steps read states the paths rounded, which may have parted
  (above): each step's logits of the kernels' path lie within twice the reference path's own distance to the
  fp32 model's logits on the same tokens (the triangle bound of two realisations of one error size; a path that
  adds an error of its own exceeds it), and the continuations may part only where the reference's top-2 margin is
  within the measured logit difference (:func:`numerics.assert_same_greedy`).
"""

from __future__ import annotations

import math

import pytest
import torch
from kernels_support import DEVICE, ON_GPU, kernel_modules
from numerics import assert_same_greedy, fp32_bound, mean_difference_bound, rel

from pace_core.analysis.calibration import calibrate
from pace_core.analysis.drift import drift
from pace_core.analysis.quality import perplexity
from pace_core.analysis.structure import structure_table
from pace_core.analysis.text import CALIBRATION_TEXT, TEST_TEXT, read_text, tokenize
from pace_core.backend import KERNELS_ENV
from pace_core.config import get_config
from pace_core.model import DEFAULT_MODEL_DIR
from pace_core.model.capture import run_with_states
from pace_core.model.loading import load_model

pytestmark = [pytest.mark.numerics,
              pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "config.json").exists(), reason="no embedded model")]

KERNEL_MODULES = kernel_modules()

FLIP_SHARE = 0.01
"""A calibration statistic's relative difference where a flip moves one entry of a sample by a code step."""
FP32_SHARE = 1e-5
"""Relative difference of values both paths compute from the same state in float32: the logits of a prompt (about
2e-7 measured), a state error's mean before any flip."""
NLL_ABS = 1e-3
TOKENS = 512 if ON_GPU else 24
"""Drift text: half prefilled, half decoded (through a flush of PACE-4's dP = 8)."""
CONFIGS = ("bf16", "rtn-int8", "rtn-int4", "pace-4", "pace-4-8") if ON_GPU else ("bf16", "rtn-int4", "pace-4")


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, device=DEVICE)


@pytest.fixture(scope="module")
def pace48(loaded):
    """PACE-4/8 with its 8-bit heads calibrated on the model (the reference backend)."""
    return calibrate(loaded, get_config("pace-4-8"), str(CALIBRATION_TEXT), tokens=64, sample_every=16).config


def both(monkeypatch, run):
    """``run()`` on the reference backend, then on the Triton kernels: ``(reference, kernels)``."""
    out = []
    for setting in ("reference", "triton"):
        monkeypatch.setenv(KERNELS_ENV, setting)
        out.append(run())
    return tuple(out)


def configs(pace48) -> list:
    return [pace48 if name == "pace-4-8" else get_config(name) for name in CONFIGS]


def test_drift_through_the_kernels_is_the_reference(loaded, pace48, monkeypatch):
    ids = tokenize(loaded.tokenizer, read_text(CALIBRATION_TEXT), TOKENS).to(DEVICE)
    ref, ker = both(monkeypatch, lambda: drift(loaded, configs(pace48), ids, TOKENS // 2, every=1))
    merged = ref.table.merge(ker.table, on=["config", "step"], suffixes=("_r", "_k"))
    assert len(merged) == len(ref.table) == len(ker.table) > 0
    assert (merged.rel_error_r > 0).all() and (merged.rel_error_k > 0).all()
    for name, rows in merged.groupby("config"):
        for column in ("rel_error", "excess_nll"):
            diff = (rows[f"{column}_k"] - rows[f"{column}_r"]).to_numpy()
            bound = mean_difference_bound(diff) + FP32_SHARE * abs(rows[f"{column}_r"]).mean()
            assert abs(diff.mean()) <= bound, f"{name} {column}: means differ by {diff.mean():.3g} > {bound:.3g}"


def test_structure_and_calibration_through_the_kernels_are_the_reference(loaded, monkeypatch):
    ids = tokenize(loaded.tokenizer, read_text(CALIBRATION_TEXT), TOKENS).to(DEVICE)
    n = ids.shape[1]
    ref, ker = both(monkeypatch, lambda: run_with_states(loaded, get_config("fp32"), ids, capture_steps=[n]).states[n])
    # the fp32 states: chunked GDN of n tokens in another order (dots of K, chunk sums)
    tol = fp32_bound(4 * n * (loaded.shape.d_k + 64))
    for layer in ref:
        assert float((ker[layer] - ref[layer]).norm() / ref[layer].norm()) <= tol
    s_ref, s_ker = structure_table(ref), structure_table(ker)
    for column in ("col_ratio", "row_ratio"):
        assert ((s_ker[column] - s_ref[column]).abs() <= 4 * tol * s_ref[column]).all()
    cal_ref, cal_ker = both(monkeypatch, lambda: calibrate(loaded, get_config("pace-4-8"), str(CALIBRATION_TEXT),
                                                            tokens=64, sample_every=16))
    assert torch.allclose(cal_ker.a, cal_ref.a, rtol=tol, atol=0)
    assert torch.allclose(cal_ker.e, cal_ref.e, rtol=FLIP_SHARE, atol=0)
    assert cal_ker.config.high_heads == cal_ref.config.high_heads


def test_perplexity_through_the_kernels_is_the_reference(loaded, pace48, monkeypatch):
    window = 64 if ON_GPU else 16
    ref, ker = both(monkeypatch, lambda: perplexity(loaded, configs(pace48), TEST_TEXT, window=window,
                                                     stride=window // 2, max_tokens=4 * window))
    ref, ker = ref.set_index("config"), ker.set_index("config")
    assert list(ref.index) == list(ker.index)
    # per-token NLLs within NLL_ABS: their mean (log perplexity) too; KL likewise, agreement by at most the
    # tokens where a near tie can swap the top-1 (one in a window of this length)
    assert ((ker.ppl.map(math.log) - ref.ppl.map(math.log)).abs() <= NLL_ABS).all()
    assert ((ker.kl - ref.kl).abs() <= NLL_ABS).all()
    assert ((ker.agreement - ref.agreement).abs() <= 1 / window).all()


def test_generation_through_the_kernels_is_the_reference(loaded, pace48, monkeypatch):
    ids = tokenize(loaded.tokenizer, "The history of the city begins in", 32).to(DEVICE)
    new = 16 if ON_GPU else 4
    for cfg in configs(pace48):
        def run(cfg=cfg):
            from pace_core.model.patch import apply_pace, remove_pace

            apply_pace(loaded.model, cfg)
            try:
                with torch.no_grad():
                    out = loaded.model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                                output_logits=True, return_dict_in_generate=True)
            finally:
                remove_pace(loaded.model)
            return out.sequences[:, ids.shape[1]:], torch.stack(out.logits)

        (tok_r, log_r), (tok_k, log_k) = both(monkeypatch, run)
        with torch.no_grad():  # the fp32 model's logits on the reference path's tokens
            fp32 = loaded.model(torch.cat([ids, tok_r], 1)).logits[:, ids.shape[1] - 1:-1].transpose(0, 1)
        own = torch.tensor([[rel(log_r[t][b], fp32[t][b]) for b in range(ids.shape[0])] for t in range(new)])
        tol = (2 * own).clamp(min=FP32_SHARE)
        tol[0] = FP32_SHARE
        assert_same_greedy(tok_k, tok_r, log_k, log_r, tol=tol)
