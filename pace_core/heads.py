"""Head-level precision (PACE_SPEC §4): which heads of a layer keep ``high_bits``.

A rounding leaves error energy ``e_h`` in head h; the head keeps it with decay ``a_h`` per token,
so with one rounding every dP tokens the retained error is ``E_h = e_h / (1 − a_h^{2 dP})``
**[seed]**. **[ours]**: ``a_h`` is the mean of ``α_t = exp(g_t)`` over calibration tokens;
``e_h`` is the mean over calibration states of ``‖Q(S) − S‖²_F`` with the config's low-bit
quantiser (:func:`pace_core.quant.fake_quantize`). In each layer the ``round(share · HV)`` heads
with the largest ``E_h`` keep the high bit width (:func:`pace_core.config.num_high_heads`, ¼ of 48
heads = 12); ties go to the lower head index.
"""

from __future__ import annotations

import torch

from pace_core.config import num_high_heads
from pace_core.errors import PaceError
from pace_core.quant import QuantSpec, check_finite, fake_quantize


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


def retained_error(e: torch.Tensor, a: torch.Tensor, dP: int) -> torch.Tensor:
    """``E_h = e_h / (1 − a_h^{2 dP})``: the error a head keeps with one rounding every dP tokens.

    e, a: same shape (e >= 0 finite, a in [0, 1]); dP >= 1. A head with a = 1 and e > 0 keeps its
    error forever: E = inf; e = 0 gives E = 0. Returns float64.
    """
    if not isinstance(dP, int) or isinstance(dP, bool) or dP < 1:
        raise PaceError(f"dP={dP!r} is not allowed; allowed: an integer >= 1")
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
    kept = 1.0 - a.pow(2 * dP)
    return torch.where(e == 0, torch.zeros_like(e), e / kept)


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
