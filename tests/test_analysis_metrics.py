"""pace_core.analysis.metrics against float64 formulas."""

import math

import pytest
import torch

from pace_core.analysis.metrics import relative_error, relative_errors, squared_norms

pytestmark = pytest.mark.numerics


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


def test_relative_error_edges_and_squared_norms():
    assert relative_error(0.0, 0.0) == 0.0 and relative_error(1.0, 0.0) == math.inf
    x = torch.randn(6, 3)
    want = torch.stack([x[:2].double().square().sum(), x[2:4].double().square().sum(), x[4:].double().square().sum()])
    assert torch.allclose(squared_norms(x, 3), want, rtol=1e-12, atol=0)
