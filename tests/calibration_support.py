"""Random calibrations of the methods that calibrate tensors per layer on a model (what a test store needs to
run them without a model): :func:`calibrated`."""

from __future__ import annotations

import torch

from pace_core.config import PaceConfig
from pace_core.methods import Calibrated


def calibrated(cfg: PaceConfig, hv: int, d_k: int, layers: int, seed: int = 0) -> PaceConfig:
    """``cfg`` with a seeded random calibration of its method's tensors for ``layers`` GDN layers of ``hv`` value
    heads and ``d_k`` key rows (DAMP: distinct outlier rows per head; STEPQuant: widths of its candidates and
    pivots, impact weights in [0.5, 1.5)), unchanged for a method without any."""
    gen = torch.Generator().manual_seed(seed)
    if cfg.method == "damp":
        return cfg.replace(calibrated=Calibrated([
            {"rows": torch.stack([torch.randperm(d_k, generator=gen)[:cfg.damp_outlier_rows] for _ in range(hv)])
             .to(torch.int16)} for _ in range(layers)]))
    if cfg.method == "stepquant":
        from pace_core.stepquant import CANDIDATES, PIVOT

        widths = torch.tensor([*CANDIDATES[cfg.bits], PIVOT], dtype=torch.int16)
        return cfg.replace(calibrated=Calibrated([
            {"widths": widths[torch.randint(len(widths), (hv,), generator=gen)],
             "impact": torch.rand(hv, d_k, generator=gen) + 0.5} for _ in range(layers)]))
    return cfg
