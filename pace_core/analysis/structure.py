"""Column and row structure of recurrent states (spec §7).

For one head's state ``S [K, V]`` the column RMS is ``‖S[:, j]‖ / √d_k`` (one value per value channel
j) and the row RMS is ``‖S[i, :]‖ / √d_v``. A head with a few columns far above the median column RMS
is the case key-axis (channel-aligned) groups are made for. Medians are the usual midpoint median
(mean of the two middle values for an even count), as numpy computes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch

from pace_core.errors import PaceError

DEFAULT_OUTLIER_THRESHOLD = 4.0


@dataclass(frozen=True)
class StructureStats:
    """Structure statistics of the heads of one state.

    col_rms [HV, V], row_rms [HV, K]: float64 RMS per column / row;
    col_ratio, row_ratio [HV]: max / median of those RMS (inf when the median is 0 and the max is not,
    nan for an all-zero head); outlier_cols [HV, V] bool: column RMS > threshold × median column RMS.
    """

    col_rms: torch.Tensor
    row_rms: torch.Tensor
    col_ratio: torch.Tensor
    row_ratio: torch.Tensor
    outlier_cols: torch.Tensor
    threshold: float

    def table(self, layer: int | None = None) -> pd.DataFrame:
        """One row per head: layer, head, col/row max, median, ratio, outlier column count and list."""
        med_c = _median(self.col_rms)
        med_r = _median(self.row_rms)
        rows = []
        for h in range(self.col_rms.shape[0]):
            rows.append(
                {
                    "layer": layer,
                    "head": h,
                    "col_rms_max": float(self.col_rms[h].max()),
                    "col_rms_median": float(med_c[h]),
                    "col_ratio": float(self.col_ratio[h]),
                    "row_rms_max": float(self.row_rms[h].max()),
                    "row_rms_median": float(med_r[h]),
                    "row_ratio": float(self.row_ratio[h]),
                    "outlier_cols": int(self.outlier_cols[h].sum()),
                    "outlier_col_index": [int(j) for j in torch.nonzero(self.outlier_cols[h]).flatten()],
                }
            )
        return pd.DataFrame(rows)


def _as_heads(S: torch.Tensor) -> torch.Tensor:
    """S [HV, K, V] or [1, HV, K, V] -> float64 [HV, K, V]."""
    if S.dim() == 4:
        if S.shape[0] != 1:
            raise PaceError(f"S: batch must be 1 for structure statistics, got shape {tuple(S.shape)}")
        S = S[0]
    if S.dim() != 3:
        raise PaceError(f"S: expected shape [HV, K, V] or [1, HV, K, V], got {tuple(S.shape)}")
    if not torch.isfinite(S).all():
        raise PaceError("S: state contains non-finite values; allowed: finite floats")
    return S.detach().to("cpu", torch.float64)


def _median(x: torch.Tensor) -> torch.Tensor:
    """Midpoint median over the last dim (numpy semantics): x [..., n] -> [...]."""
    return torch.quantile(x, 0.5, dim=-1)


def column_rms(S: torch.Tensor) -> torch.Tensor:
    """Column RMS ``‖S[:, j]‖ / √d_k``: S [..., K, V] -> [..., V] float64."""
    S = S.to(torch.float64)
    return torch.sqrt((S * S).mean(dim=-2))


def row_rms(S: torch.Tensor) -> torch.Tensor:
    """Row RMS ``‖S[i, :]‖ / √d_v``: S [..., K, V] -> [..., K] float64."""
    S = S.to(torch.float64)
    return torch.sqrt((S * S).mean(dim=-1))


def _ratio(rms: torch.Tensor) -> torch.Tensor:
    mx = rms.max(dim=-1).values
    med = _median(rms)
    return torch.where(med > 0, mx / torch.where(med > 0, med, 1.0), torch.where(mx > 0, torch.inf, torch.nan))


def structure_stats(S: torch.Tensor, threshold: float = DEFAULT_OUTLIER_THRESHOLD) -> StructureStats:
    """Structure statistics of one layer's state.

    S [HV, K, V] or [1, HV, K, V]; threshold > 0: a column is an outlier when its RMS exceeds
    ``threshold`` × the head's median column RMS.
    """
    if not threshold > 0:
        raise PaceError(f"threshold: must be > 0 (e.g. 4), got {threshold}")
    S64 = _as_heads(S)
    c = column_rms(S64)
    r = row_rms(S64)
    outliers = c > threshold * _median(c).unsqueeze(-1)
    return StructureStats(c, r, _ratio(c), _ratio(r), outliers, float(threshold))


def strongest_outlier_head(states: dict[int, torch.Tensor]) -> tuple[int, int]:
    """(layer, value head) whose column RMS max/median is the largest over ``{layer: S [HV, K, V]}``
    (heads whose ratio is undefined, an all-zero head, are skipped; the first head when none is)."""
    best, where = -1.0, None
    for layer, S in sorted(states.items()):
        ratio = torch.nan_to_num(structure_stats(S).col_ratio, nan=-1.0, posinf=-1.0)
        head = int(torch.argmax(ratio))
        if float(ratio[head]) > best:
            best, where = float(ratio[head]), (layer, head)
    return where if where is not None else (min(states), 0)


def structure_table(states: dict[int, torch.Tensor], threshold: float = DEFAULT_OUTLIER_THRESHOLD) -> pd.DataFrame:
    """Per layer and head structure table for ``{gdn_layer: S [1, HV, K, V]}``."""
    if not states:
        raise PaceError("states: need at least one layer's state")
    return pd.concat(
        [structure_stats(S, threshold).table(layer) for layer, S in sorted(states.items())], ignore_index=True
    )
