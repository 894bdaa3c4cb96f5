"""Error measures shared by the analyses (spec §7): the relative Frobenius error of a state and its
pooling over GDN layers."""

from __future__ import annotations

import math

import torch


def relative_error(diff_sq: float | torch.Tensor, ref_sq: float | torch.Tensor) -> float:
    """``sqrt(Σ (S̃ − S)² / Σ S²)`` from the two sums of squares: 0 when both are 0, inf when only the
    reference is 0."""
    diff_sq, ref_sq = float(diff_sq), float(ref_sq)
    if ref_sq > 0:
        return math.sqrt(diff_sq / ref_sq)
    return 0.0 if diff_sq == 0 else math.inf


def squared_norms(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Sum of squares of each of ``groups`` equal slices of ``x`` along its first dim, float64 ``[groups]``
    (e.g. the configurations of a stack ``[groups·L, ...]``)."""
    return x.double().square().reshape(groups, -1).sum(1)


def relative_errors(states: dict[int, torch.Tensor], ref: dict[int, torch.Tensor]) -> tuple[dict[int, float], float]:
    """Per-layer and pooled ``‖S̃ − S‖_F / ‖S‖_F`` for ``{layer: S [B, HV, K, V]}`` (pooled: the layers'
    sums of squares added before the ratio)."""
    num, den, per = 0.0, 0.0, {}
    for layer, S in ref.items():
        d = float((states[layer].double() - S.double()).square().sum())
        n = float(S.double().square().sum())
        per[layer] = relative_error(d, n)
        num, den = num + d, den + n
    return per, relative_error(num, den)
