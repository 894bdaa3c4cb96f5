"""GPU results = CPU results: every analysis run through the Triton kernels (pace_core.backend's ``triton``
setting: interpreted on CPU tensors here, compiled on CUDA in the GPU check) against the same analysis on the
PyTorch reference, on the embedded model.

On the CPU the text is short (the interpreter runs each kernel program in numpy); with
``PACE_KERNEL_TESTS=cuda`` the same comparisons run on the GPU over longer texts and more configurations.

Tolerances, from what the two backends compute differently:

- unrounded arithmetic (fp32 reference states, structure statistics, calibration decays) differs only by
  summation order: :func:`numerics.fp32_bound` of the longest dependent chain;
- a rounding to few bits after two such paths puts a value on the other side of a rounding boundary where it
  lies within float32 rounding of it (tests/numerics.py): one code step in a few entries. Such a flip moves
  a state's error by one step in one entry among ``HV·K·V`` per layer, so the relative state error of a
  configuration (drift) agrees to :data:`FLIP_SHARE` of itself; the measured difference is 7e-4 for bf16
  (whose rounding step is the finest, 2^-8 relative, so flips are most frequent), 5e-6 for RTN-INT4, 7e-8
  for PACE-4;
- a log-probability moves with the state it reads: means of per-token NLLs (a drift's mean excess NLL,
  log perplexity, KL) agree to :data:`NLL_ABS` nats, a 1e-3 relative change of a logit margin, which a few
  one-step flips per layer do not reach (measured up to 2e-4); a single token's NLL to :data:`STEP_NLL_ABS`:
  at dP = 1 integer rounding carries each flip into the rounding of every later token, so the trajectories
  part by a few code steps (measured up to 1.8e-3 nats for RTN-INT4, 7e-6 for bf16, 1e-6 for PACE-4);
- greedy generations may part only where the reference's top-2 margin is within the measured logit
  difference (:func:`numerics.assert_same_greedy`).
"""

from __future__ import annotations

import math

import pytest
import torch
from kernels_support import DEVICE, ON_GPU, kernel_modules
from numerics import assert_same_greedy, fp32_bound

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
NLL_ABS = 1e-3
STEP_NLL_ABS = 5e-3
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
    assert ((merged.rel_error_k - merged.rel_error_r).abs() <= FLIP_SHARE * merged.rel_error_r).all()
    assert ((merged.excess_nll_k - merged.excess_nll_r).abs() <= STEP_NLL_ABS).all()
    assert (merged.rel_error_r > 0).all()
    summary = ref.summary.merge(ker.summary, on="config", suffixes=("_r", "_k"))
    assert ((summary.mean_excess_nll_k - summary.mean_excess_nll_r).abs() <= NLL_ABS).all()


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
        assert_same_greedy(tok_k, tok_r, log_k, log_r, tol=NLL_ABS)
