"""Head-level precision (PACE_SPEC §4): which heads of a layer keep ``high_bits``.

A rounding leaves error energy ``e_h`` in head h; the head keeps it with decay ``a_h`` per token,
so with one rounding every dP tokens the retained error is ``E_h = e_h / (1 − a_h^{2 dP})``
**[seed]**. **[ours]**: ``a_h`` is the mean of ``α_t = exp(g_t)`` over calibration tokens;
``e_h`` is the mean over calibration states of ``‖Q(S) − S‖²_F`` with the config's low-bit
quantiser (:func:`pace_core.quant.fake_quantize`). In each layer the ``round(share · HV)`` heads
with the largest ``E_h`` keep the high bit width (:func:`num_high_heads`, ¼ of 48
heads = 12); ties go to the lower head index.
"""

from __future__ import annotations

import math

import torch

from pace_core.errors import PaceError
from pace_core.quant import QuantSpec, check_finite, fake_quantize
from pace_core.settings import Configuration


def num_high_heads(share: float, num_heads: int) -> int:
    """Heads per layer kept at ``high_bits``: ``share · num_heads`` rounded half up (¼ of 48 = 12)."""
    return math.floor(share * num_heads + 0.5)


def head_decay(g: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean per-token decay ``a_h = mean_t exp(g_t)`` per value head.

    g [T, HV] or [B, T, HV]: log decays (<= 0); mask [T] or [B, T] bool (optional): tokens to use
    (e.g. not padding). Returns a_h [HV] in float64.
    """
    if not isinstance(g, torch.Tensor) or g.dim() not in (2, 3) or not g.is_floating_point():
        raise PaceError(f"g must be a float tensor [T, HV] or [B, T, HV]; got shape {tuple(getattr(g, 'shape', ()))}")
    check_finite(g, "g")
    if (g > 0).any():
        raise PaceError("g holds positive log decays; allowed: g <= 0 (decays exp(g) in (0, 1])")
    alpha = g.to(torch.float64).exp().reshape(-1, g.shape[-1])
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != tuple(g.shape[:-1]):
            raise PaceError(f"mask must be a bool tensor of shape {tuple(g.shape[:-1])}; "
                            f"got {getattr(mask, 'dtype', type(mask).__name__)} {tuple(getattr(mask, 'shape', ()))}")
        alpha = alpha[mask.reshape(-1).to(alpha.device)]
    if alpha.shape[0] == 0:
        raise PaceError("g has no (unmasked) tokens; allowed: at least one calibration token")
    return alpha.mean(0)


def rounding_error(states: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Mean rounding error energy per head, ``e_h = mean_n ‖Q(S_n,h) − S_n,h‖²_F``.

    states [N, HV, K, V] (any float dtype; the error is summed in float64); spec: the quantiser.
    Returns e_h [HV] float64.
    """
    if not isinstance(states, torch.Tensor) or states.dim() != 4 or not states.is_floating_point():
        raise PaceError("states must be a float tensor [N, HV, K, V]; "
                        f"got shape {tuple(getattr(states, 'shape', ()))}")
    if states.shape[0] == 0:
        raise PaceError("states holds no calibration states; allowed: N >= 1")
    err = fake_quantize(states, spec, name="states").to(torch.float64) - states.to(torch.float64)
    return err.square().sum(dim=(-2, -1)).mean(0)


MAX_DECAY = 1.0 - 2.0**-20
"""Decays are taken as at most this in :func:`retained_error`: a head (or row) whose calibration decays
are all 1 to float64 precision keeps its error for about 2^19 roundings instead of forever, so that such
heads still rank by their error energy."""


def retained_error(e: torch.Tensor, a: torch.Tensor, dP: int) -> torch.Tensor:
    """``E = e / (1 − a^{2 dP})``: the error energy kept with one rounding every dP tokens (dP = 1:
    per-token rounding, ``Σ_t a^{2t} e``). The one formula for heads (PACE-4/8) and DAMP's rows.

    e, a: same shape (e >= 0 finite, a in [0, 1], taken as at most :data:`MAX_DECAY`); dP >= 1 (the
    configuration's). Returns float64; e = 0 gives E = 0."""
    e = torch.as_tensor(e, dtype=torch.float64)
    a = torch.as_tensor(a, dtype=torch.float64, device=e.device)
    if e.shape != a.shape:
        raise PaceError(f"e {tuple(e.shape)} and a {tuple(a.shape)} differ in shape; allowed: the same shape")
    check_finite(e, "e")
    check_finite(a, "a")
    if (e < 0).any():
        raise PaceError("e holds negative error energies; allowed: e >= 0")
    if ((a < 0) | (a > 1)).any():
        raise PaceError("a holds decays outside [0, 1]; allowed: 0 <= a <= 1")
    return e / (1.0 - a.clamp(max=MAX_DECAY).pow(2 * dP))


def high_heads_for(
    a: torch.Tensor, e: torch.Tensor, cfg: Configuration
) -> tuple[torch.Tensor, tuple[tuple[int, ...], ...]]:
    """The allocation of PACE-4/8 (spec §4) from a calibration: ``E [L, HV]`` (:func:`retained_error` at the
    config's dP) and the heads per layer that keep ``cfg.high_bits`` (:func:`allocate_high_heads` at its
    share). ``a, e [L, HV]``."""
    E = retained_error(e, a, cfg.decode_period)
    return E, allocate_high_heads(E, cfg.high_share)


def allocate_high_heads(E: torch.Tensor, share: float) -> tuple[tuple[int, ...], ...]:
    """Per layer the ``num_high_heads(share, HV)`` heads with the largest retained error.

    E [L, HV] (float, no NaN; inf allowed); share in [0, 1]. Returns one ascending tuple of head
    indices per layer; ties go to the lower head index.
    """
    if not isinstance(E, torch.Tensor) or E.dim() != 2 or not E.is_floating_point():
        raise PaceError(f"E must be a float tensor [L, HV]; got shape {tuple(getattr(E, 'shape', ()))}")
    if torch.isnan(E).any():
        raise PaceError("E holds NaN; allowed: retained errors >= 0 (inf allowed)")
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
        raise PaceError(f"share={share!r} is not allowed; allowed: a number in [0, 1]")
    n = num_high_heads(float(share), E.shape[1])
    heads = []
    for row in E.to(torch.float64).cpu():
        order = sorted(range(row.numel()), key=lambda h: (-row[h].item(), h))
        heads.append(tuple(sorted(order[:n])))
    return tuple(heads)
