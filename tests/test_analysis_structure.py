import numpy as np
import pytest
import torch

from pace_core.analysis.structure import column_rms, row_rms, strongest_outlier_head, structure_stats, structure_table
from pace_core.errors import PaceError


def _numpy_reference(S: np.ndarray, thr: float):
    col = np.sqrt((S**2).sum(axis=1) / S.shape[1])  # [HV, V]
    row = np.sqrt((S**2).sum(axis=2) / S.shape[2])  # [HV, K]
    col_ratio = col.max(axis=1) / np.median(col, axis=1)
    row_ratio = row.max(axis=1) / np.median(row, axis=1)
    outl = col > thr * np.median(col, axis=1, keepdims=True)
    return col, row, col_ratio, row_ratio, outl


@pytest.mark.parametrize("shape", [(3, 16, 8), (1, 2, 8, 6)])
def test_matches_numpy_float64(shape):
    g = torch.Generator().manual_seed(sum(shape))
    S = torch.randn(shape, generator=g, dtype=torch.float32)
    heads = S.reshape(-1, *S.shape[-2:])
    # plant outlier columns of different sizes
    heads[0, :, 1] *= 9.0
    heads[-1, :, 3] *= 3.0
    st = structure_stats(S, threshold=4.0)
    col, row, cr, rr, outl = _numpy_reference(heads.double().numpy(), 4.0)
    np.testing.assert_allclose(st.col_rms.numpy(), col, rtol=1e-12)
    np.testing.assert_allclose(st.row_rms.numpy(), row, rtol=1e-12)
    np.testing.assert_allclose(st.col_ratio.numpy(), cr, rtol=1e-12)
    np.testing.assert_allclose(st.row_ratio.numpy(), rr, rtol=1e-12)
    assert (st.outlier_cols.numpy() == outl).all()
    assert st.outlier_cols[0, 1]


def test_threshold_is_a_parameter():
    S = torch.ones(1, 4, 6, dtype=torch.float64)
    S[0, :, 2] = 3.0  # column RMS 3 vs median 1
    assert structure_stats(S, threshold=2.5).outlier_cols[0].tolist() == [False, False, True, False, False, False]
    assert not structure_stats(S, threshold=3.0).outlier_cols.any()
    assert structure_stats(S).col_ratio[0].item() == pytest.approx(3.0)
    # column RMS of ones is 1, row RMS of a row with one 3 among six entries
    assert column_rms(S)[0, 0].item() == pytest.approx(1.0)
    assert row_rms(S)[0, 0].item() == pytest.approx(np.sqrt((5 + 9) / 6))


def test_zero_head_and_table():
    S = torch.zeros(2, 4, 4)
    S[1] = torch.randn(4, 4)
    st = structure_stats(S)
    assert torch.isnan(st.col_ratio[0]) and torch.isfinite(st.col_ratio[1])
    tab = structure_table({3: S.unsqueeze(0), 1: S.unsqueeze(0)})
    assert list(tab["layer"]) == [1, 1, 3, 3] and list(tab["head"]) == [0, 1, 0, 1]
    assert tab.loc[1, "col_ratio"] == pytest.approx(st.col_ratio[1].item())


def test_bad_input():
    with pytest.raises(PaceError, match="threshold"):
        structure_stats(torch.ones(1, 2, 2), threshold=0)
    with pytest.raises(PaceError, match="S:"):
        structure_stats(torch.ones(2, 2))
    with pytest.raises(PaceError, match="non-finite"):
        structure_stats(torch.full((1, 2, 2), float("nan")))
    with pytest.raises(PaceError, match="states"):
        structure_table({})


def test_strongest_outlier_head_is_the_largest_column_ratio():
    g = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    states = {layer: torch.randn(4, 16, 16, generator=g) for layer in (0, 1, 2, 4)}
    states[2][3, :, 5] *= 40.0  # one outlier column in layer 2, head 3
    states[4][1] = 0.0          # an all-zero head (undefined ratio) is skipped
    assert strongest_outlier_head(states) == (2, 3)
    assert strongest_outlier_head({7: torch.zeros(2, 4, 4)}) == (7, 0)
