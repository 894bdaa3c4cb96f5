import math

import pytest
import torch

from pace_core.config import get_config
from pace_core.errors import PaceError
from pace_core.heads import MAX_DECAY, allocate_high_heads, head_decay, retained_error, rounding_error
from pace_core.quant import QuantSpec, fake_quantize

pytestmark = pytest.mark.numerics


def test_head_decay_is_the_mean_of_exp_g():
    g = -torch.rand(5, 7, 3, dtype=torch.float32) * 3
    a = head_decay(g)
    for h in range(3):
        ref = sum(math.exp(float(g[b, t, h])) for b in range(5) for t in range(7)) / 35
        assert a[h].item() == pytest.approx(ref, rel=1e-12)
    assert a.dtype == torch.float64 and a.shape == (3,)
    assert torch.equal(head_decay(g[0]), head_decay(g[:1]))
    mask = torch.rand(5, 7) > 0.4
    mask[0, 0] = True
    am = head_decay(g, mask)
    for h in range(3):
        vals = [math.exp(float(g[b, t, h])) for b in range(5) for t in range(7) if mask[b, t]]
        assert am[h].item() == pytest.approx(sum(vals) / len(vals), rel=1e-12)


def test_head_decay_errors():
    with pytest.raises(PaceError, match="g holds positive log decays"):
        head_decay(torch.tensor([[0.1, -1.0]]))
    with pytest.raises(PaceError, match="g must be a float tensor"):
        head_decay(torch.zeros(3))
    with pytest.raises(PaceError, match="non-finite"):
        head_decay(torch.tensor([[float("nan")]]))
    with pytest.raises(PaceError, match="mask must be a bool tensor of shape \\(2, 4\\)"):
        head_decay(torch.zeros(2, 4, 3), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(PaceError, match="no \\(unmasked\\) tokens"):
        head_decay(torch.zeros(2, 4, 3), torch.zeros(2, 4, dtype=torch.bool))


def test_rounding_error_per_head_against_a_loop():
    torch.manual_seed(0)
    states = torch.randn(4, 3, 16, 8)
    states[:, 1] *= 10  # a head with larger values has larger rounding error
    spec = QuantSpec(bits=4, symmetric=True, axis="key", group_size=8)
    e = rounding_error(states, spec)
    for h in range(3):
        ref = 0.0
        for n in range(4):
            x = states[n, h]
            diff = fake_quantize(x, spec).double() - x.double()
            ref += float((diff * diff).sum())
        assert e[h].item() == pytest.approx(ref / 4, rel=1e-12)
    assert e[1] > e[0] and e[1] > e[2]
    assert (rounding_error(states, QuantSpec(8, True, "key", 8)) < e).all()
    assert torch.equal(rounding_error(torch.zeros(2, 3, 16, 8), spec), torch.zeros(3, dtype=torch.float64))
    exact = torch.tensor([-7.0, 7.0, 3.0, -2.0]).repeat(2, 2, 2, 1)  # integers with amax = qmax: exact codes
    assert torch.equal(rounding_error(exact, QuantSpec(4, True, "value", 4)), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(PaceError, match="states must be a float tensor \\[N, HV, K, V\\]"):
        rounding_error(torch.zeros(3, 16, 8), spec)
    with pytest.raises(PaceError, match="N >= 1"):
        rounding_error(torch.zeros(0, 3, 16, 8), spec)


def test_retained_error_formula():
    e = torch.tensor([1.0, 2.0, 0.5, 0.0, 3.0])
    a = torch.tensor([0.5, 0.9, 0.99, 1.0, 1.0])
    for dp in (1, 8, 32):
        E = retained_error(e, a, dp)
        for h in range(3):
            assert E[h].item() == pytest.approx(float(e[h]) / (1 - float(a[h]) ** (2 * dp)), rel=1e-12)
        # a head that never forgets is taken at MAX_DECAY: finite, and ranked by its error energy
        assert E[3] == 0 and E[4].item() == pytest.approx(3.0 / (1 - MAX_DECAY ** (2 * dp)), rel=1e-12)
        assert E[4] > E[:3].max() and math.isfinite(E[4])
    # a longer period retains less error (the decay between roundings shrinks it)
    assert (retained_error(e[:3], a[:3], 8) < retained_error(e[:3], a[:3], 1)).all()
    with pytest.raises(PaceError, match="a holds decays outside \\[0, 1\\]"):
        retained_error(e, a + 0.5, 8)
    with pytest.raises(PaceError, match="e holds negative"):
        retained_error(-e, a, 8)
    with pytest.raises(PaceError, match="differ in shape"):
        retained_error(e, a[:2], 8)


def test_allocate_high_heads():
    E = torch.tensor([[0.1, 5.0, 0.3, 2.0, 0.0, 1.0, 9.0, 0.2],
                      [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
                      [0.0, float("inf"), 0.5, 0.0, 0.0, 0.0, 0.7, 0.0]])
    assert allocate_high_heads(E, 0.25) == ((1, 6), (0, 1), (1, 6))
    assert allocate_high_heads(E, 0.5) == ((1, 3, 5, 6), (0, 1, 2, 3), (0, 1, 2, 6))
    assert allocate_high_heads(E, 0.0) == ((), (), ())
    assert allocate_high_heads(E, 1) == (tuple(range(8)),) * 3
    torch.manual_seed(1)
    R = torch.rand(6, 48, dtype=torch.float64)
    for layer, heads in enumerate(allocate_high_heads(R, 0.25)):
        assert len(heads) == 12
        assert set(heads) == set(torch.topk(R[layer], 12).indices.tolist())
    with pytest.raises(PaceError, match="E holds NaN"):
        allocate_high_heads(torch.tensor([[float("nan"), 1.0]]), 0.5)
    with pytest.raises(PaceError, match="share=1.5"):
        allocate_high_heads(E, 1.5)
    with pytest.raises(PaceError, match="E must be a float tensor \\[L, HV\\]"):
        allocate_high_heads(E[0], 0.25)


def test_allocation_on_synthetic_states_and_decays_feeds_the_config():
    """Heads with slow decay and outlier columns keep 8 bits; the allocation is a valid pace-4-8 config."""
    torch.manual_seed(3)
    layers, hv, T, K, V = 2, 8, 64, 32, 32
    cfg = get_config("pace-4-8")
    spec = cfg.quant_spec()
    E = []
    for layer in range(layers):
        slow = {1 + layer, 5}
        g = torch.stack([torch.full((T,), math.log(0.999 if h in slow else 0.6)) for h in range(hv)], dim=1)
        states = torch.randn(10, hv, K, V)
        for h in slow:
            states[:, h, :, 3] *= 20  # an outlier column
        E.append(retained_error(rounding_error(states, spec), head_decay(g), cfg.decode_period))
    heads = allocate_high_heads(torch.stack(E), cfg.high_share)
    assert heads == ((1, 5), (2, 5))
    cal = cfg.replace(high_heads=heads)
    assert cal.head_bits(0, hv) == (4, 8, 4, 4, 4, 8, 4, 4)
