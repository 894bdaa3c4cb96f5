"""Random calibrations of the methods that calibrate tensors per layer on a model (what a test store needs to
run them without a model): :func:`calibrated`."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pace_core.config import PaceConfig
from pace_core.methods import Calibrated, method_of


def calibrated(cfg: PaceConfig, hv: int, d_k: int, layers: int, seed: int = 0, d_v: int | None = None) -> PaceConfig:
    """``cfg`` with a seeded random calibration of its method's tensors for ``layers`` GDN layers of ``hv`` value
    heads, ``d_k`` key rows and ``d_v`` value columns (default ``d_k``) (DAMP: distinct outlier rows per head;
    STEPQuant: widths of its candidates and pivots, impact weights in [0.5, 1.5); static scales: the method's own
    calibration of four standard normal states per layer), unchanged for a configuration without any."""
    with torch.device("cpu"):  # seeded CPU draws, also where CUDA is the default device (the GPU check)
        gen = torch.Generator().manual_seed(seed)
        if method_of(cfg).calibration(cfg) is None:
            return cfg
        if cfg.scales == "static":
            states = {i: torch.randn(4, hv, d_k, d_k if d_v is None else d_v, generator=gen) for i in range(layers)}
            return cfg.replace(calibrated=Calibrated(method_of(cfg).calibrate(cfg, SimpleNamespace(states=states),
                                                                               list(range(layers)))))
        if cfg.method == "damp":
            return cfg.replace(calibrated=Calibrated([
                {"rows": torch.stack([torch.randperm(d_k, generator=gen)[:cfg.damp_outlier_rows] for _ in range(hv)])
                 .to(torch.int16)} for _ in range(layers)]))
        if cfg.method == "stepquant":
            from pace_core.methods.stepquant.algorithm import CANDIDATES, PIVOT

            widths = torch.tensor([*CANDIDATES[cfg.bits], PIVOT], dtype=torch.int16)
            return cfg.replace(calibrated=Calibrated([
                {"widths": widths[torch.randint(len(widths), (hv,), generator=gen)],
                 "impact": torch.rand(hv, d_k, generator=gen) + 0.5} for _ in range(layers)]))
        raise ValueError(f"tests/calibration_support has no random calibration of {cfg.name!r} (method {cfg.method!r})")
