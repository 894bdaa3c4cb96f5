"""pace_core.methods.groups: RTN's and PACE's packed groups with the combinations the PACE paper did not test
(stochastic rounding, a Hadamard rotation along the key axis, static scales), against float64 references written
from their definitions (the module docstring, pace_core.quant's)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from pace_core import quant
from pace_core.accounting import resident_bits, state_bytes, state_bytes_per_sequence
from pace_core.config import get_config
from pace_core.errors import PaceError
from pace_core.memory import held_bytes
from pace_core.methods import method_of, state_format
from pace_core.methods.groups import StaticCodes, calibrate
from pace_core.recurrence import prepare_qk
from pace_core.shapes import ModelShape
from pace_core.state_store import StateStore

pytestmark = pytest.mark.numerics

B, H, HV, K, V = 2, 2, 4, 64, 32
SHAPE = ModelShape("groups", 3, 2, H, HV, K, V, 0, gdn_layers=(0, 2))


def _grouped(x: torch.Tensor, g: int, axis: str) -> tuple[torch.Tensor, int]:
    """``x [..., K, V]`` with each group of ``g`` on its own dim, and that dim (a view)."""
    *lead, k, v = x.shape
    return (x.reshape(*lead, k // g, g, v), -2) if axis == "key" else (x.reshape(*lead, k, v // g, g), -1)


def _fp16(ratio: torch.Tensor) -> torch.Tensor:
    """A ratio stored as an fp16 scale (float64 out): rounded to float32, clamped into [2^-14, 65504], to fp16."""
    return ratio.float().clamp(2.0**-14, 65504.0).half().double()


def ref_scales(x: torch.Tensor, g: int, axis: str, qmax: int) -> torch.Tensor:
    """Each entry's symmetric group scale ``fp16(amax / qmax)`` (float64, shaped like ``x``; all groups non-zero)."""
    xg, dim = _grouped(x.double(), g, axis)
    return _fp16(xg.abs().amax(dim, keepdim=True) / qmax).expand_as(xg).reshape(x.shape)


def random_state(seed: int, shape=(B, HV, K, V)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def stored_codes(c) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in c.stored_tensors().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


# --- stochastic rounding ------------------------------------------------------------------------------------------


def test_stochastic_codes_are_the_floor_of_x_over_s_plus_the_layers_draws():
    """Codes ``floor(x/s + u)``: ``u`` one uniform draw per value from a generator seeded with
    ``seed · 2^16 + GDN layer``, in the state's row-major order; so each code is ``floor(x/s)`` or ``ceil(x/s)``.
    The implementation adds in float32: it may land on the other side of an integer where ``x/s + u`` lies within
    float32 rounding of it (|x/s + u| <= 8: 2^-20), so the draws are compared away from integers (1e-5)."""
    cfg = get_config("pace-4-sr").replace(group_size=16, rounding_seed=3)
    S = random_state(1)
    fmt = state_format(cfg, (4,) * HV, gdn_index=2)
    c, values = fmt.store_loaded(S)
    assert torch.equal(values, fmt.load(c))
    s = ref_scales(S, 16, "key", 7)
    y = S.double() / s
    q = values.double() / s
    assert torch.equal(q, q.round())  # integer codes times the group's fp16 scale
    lo, hi = y.floor().clamp(-7, 7), y.ceil().clamp(-7, 7)
    assert ((q == lo) | (q == hi)).all()
    u = torch.rand(S.shape, generator=torch.Generator().manual_seed(3 * 2**16 + 2)).double()
    t = y + u
    clear = (t - t.round()).abs() > 1e-5
    assert clear.float().mean() > 0.99
    assert torch.equal(q[clear], t.floor().clamp(-7, 7)[clear])
    assert 0.3 < float((q == hi).double().mean()) < 0.7  # both sides occur (x/s is not an integer)


def test_stochastic_rounding_is_reproducible_and_advances():
    """The same configuration, seed, layer and inputs give the same codes (a fresh format, or the same one started
    again); each further rounding draws new numbers; another seed or another layer other codes. Through a store:
    the same prompt and tokens give bit-identical checkpoints, also after a reset."""
    cfg = get_config("pace-4-sr").replace(group_size=16)
    S = random_state(2)

    def codes(cfg, layer=0, fmt=None):
        fmt = fmt or state_format(cfg, (4,) * HV, gdn_index=layer)
        return stored_codes(fmt.store(S)), fmt

    first, fmt = codes(cfg)
    assert same(codes(cfg)[0], first)
    second, _ = codes(cfg, fmt=fmt)
    assert not same(second, first)
    fmt.restart()
    assert same(codes(cfg, fmt=fmt)[0], first)
    assert not same(codes(cfg, layer=1)[0], first)
    assert not same(codes(cfg.replace(rounding_seed=1))[0], first)
    nearest = stored_codes(state_format(get_config("pace-4").replace(group_size=16), (4,) * HV).store(S))
    assert not same(first, nearest) and torch.equal(first["scale"], nearest["scale"])  # the same scales

    tokens = _tokens(14, seed=3)

    def run(store):
        for layer in (0, 2):
            store.prefill(layer, *(x[:, :9] for x in tokens))
            store.decode(layer, *(x[:, 9:] for x in tokens))
        return [stored_codes(store.layer(layer).checkpoint) for layer in (0, 2)]

    store = StateStore(cfg, SHAPE, B, "cpu", H, HV, K, V, [0, 2])
    once = run(store)
    assert all(same(a, b) for a, b in zip(run(StateStore(cfg, SHAPE, B, "cpu", H, HV, K, V, [0, 2])), once))
    store.reset()
    assert all(same(a, b) for a, b in zip(run(store), once))
    assert not same(once[0], once[1])  # each layer its own generator


def test_stochastic_rounding_is_unbiased():
    """The mean of N seeded roundings of one state converges to it: each rounding is off by less than one step s
    with variance at most s²/4, so the mean is off by at most 5 s / (2 √N) (5 standard deviations; N = 4000:
    0.04 s) plus the bias of float32's ``x/s + u`` (2^-20 s) and of a clamped code at ±qmax (the fp16 scale's
    rounding: at most 7 · 2^-11 s). Round to nearest misses that bound for most values."""
    cfg = get_config("pace-4-sr").replace(group_size=16)
    S = random_state(4, (1, 2, 16, 8))
    fmt = state_format(cfg, (4, 4))
    n = 4000
    total = torch.zeros(S.shape, dtype=torch.float64)
    for _ in range(n):
        total += fmt.store_loaded(S)[1].double()
    s = ref_scales(S, 16, "key", 7)
    err = (total / n - S.double()).abs() / s
    bound = 5 / (2 * math.sqrt(n)) + 2.0**-20 + 7 * 2.0**-11
    assert float(err.max()) <= bound
    nearest = state_format(get_config("pace-4").replace(group_size=16), (4, 4)).store_loaded(S)[1]
    assert float(((nearest.double() - S.double()).abs() / s > bound).double().mean()) > 0.8


# --- Hadamard rotation along the key axis ---------------------------------------------------------------------------


def sylvester(n: int) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix of size n (float64), as Kronecker powers of [[1, 1], [1, -1]]/√2."""
    h = torch.ones(1, 1, dtype=torch.float64)
    base = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64) / math.sqrt(2)
    while h.shape[0] < n:
        h = torch.kron(base, h)
    return h


def test_rotated_format_stores_q_of_h_s_and_loads_its_rotation_back():
    """``Hᵀ Q(H S)`` from the definitions: H orthonormal (H Hᵀ = I); ``H S`` along each head's key axis rounded once
    to float32; the group quantiser's codes ``round(y / s)`` (half to even), s = fp16(amax / qmax); the loaded
    state ``Hᵀ Ŷ`` rounded once to float32. The stored codes equal the reference's (the same float32 ``y``);
    the loaded state differs from the float64 ``Hᵀ Ŷ`` by its one float32 rounding (2^-24 relative per entry) and
    the two float64 sums' orders (K · 2^-53 times the sum of the terms' magnitudes)."""
    H64 = sylvester(K)
    assert torch.allclose(H64 @ H64.T, torch.eye(K, dtype=torch.float64), rtol=0, atol=1e-15)
    cfg = get_config("pace-4-hadamard").replace(group_size=16)
    S = random_state(5)
    fmt = state_format(cfg, (4,) * HV)
    c, values = fmt.store_loaded(S)
    loaded = fmt.load(c)
    assert torch.equal(values, loaded)
    Y = torch.einsum("ij,bhjv->bhiv", H64, S.double()).float().double()
    s = ref_scales(Y, 16, "key", 7)
    Y_hat = (Y / s).round().clamp(-7, 7) * s
    assert torch.equal(quant.dequantize(c).double(), Y_hat)
    want = torch.einsum("ji,bhjv->bhiv", H64, Y_hat)
    terms = torch.einsum("ji,bhjv->bhiv", H64.abs(), Y_hat.abs())
    assert ((loaded.double() - want).abs() <= 2.0**-24 * want.abs() + K * 2.0**-53 * terms).all()


def test_rotation_helps_a_state_with_outlier_key_rows():
    """Key-axis groups of 64 hold a whole column of a head: one outlier key row per head (40x the other rows) sets
    every column's step, which rounds the other 63 entries to 0. Rotated, the outlier is spread over all rows and
    the column's values are rounded on a step its outlier shares with them: the error falls more than twofold
    (measured: 0.156 -> 0.057 of the state's norm)."""
    S = 0.05 * random_state(6)
    rows = torch.tensor([3, 17, 40, 58])
    S[:, torch.arange(HV), rows, :] *= 40
    errors = {}
    for name in ("pace-4", "pace-4-hadamard"):
        fmt = state_format(get_config(name), (4,) * HV)
        errors[name] = float((fmt.load(fmt.store(S)).double() - S.double()).norm() / S.double().norm())
    assert errors["pace-4-hadamard"] < 0.5 * errors["pace-4"]


# --- static scales --------------------------------------------------------------------------------------------------


def snapshots(seed: int, n: int = 6) -> torch.Tensor:
    """``n`` calibration states ``[n, HV, K, V]`` whose columns differ in scale (as real states' do)."""
    return random_state(seed, (n, HV, K, V)) * torch.linspace(0.2, 3.0, V)


def static_config(name: str, **changes):
    cfg = get_config(name).replace(**changes)
    return cfg.replace(calibrated=_calibrated(cfg, snapshots(7)))


def _calibrated(cfg, states: torch.Tensor):
    from pace_core.methods import Calibrated

    return Calibrated(calibrate(cfg, SimpleNamespace(states={0: states, 2: states}), [0, 2]))


def ref_range(states: torch.Tensor, g: int, axis: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each group's max |x|, min(x, 0) and max(x, 0) over the snapshots ``[N, HV, K, V]`` (float64, ``[HV,
    groups]``)."""
    xg, dim = _grouped(states.double(), g, axis)
    return (xg.abs().amax(dim).amax(0), xg.amin(dim).amin(0).clamp(max=0), xg.amax(dim).amax(0).clamp(min=0))


def test_calibrated_ranges_are_each_groups_range_over_the_snapshots_rounded_outward():
    states = snapshots(8)
    for cfg in (get_config("pace-4-static").replace(group_size=16),
                get_config("rtn-int4").replace(scales="static", symmetric=False),
                get_config("pace-4-static").replace(key_hadamard=True, group_size=32)):
        [layer] = calibrate(cfg, SimpleNamespace(states={0: states}), [0])
        x = torch.einsum("ij,nhjv->nhiv", sylvester(K), states.double()).float() if cfg.key_hadamard else states
        amax, low, high = ref_range(x, cfg.group_size, cfg.group_axis)
        want = {"amax": amax} if cfg.symmetric else {"low": low, "high": high}
        assert set(layer) == {("rotated_" if cfg.key_hadamard else "") + n for n in want}
        for name, t in layer.items():
            ref = want[name.removeprefix("rotated_")]
            assert t.dtype == torch.float16 and t.shape == ref.shape
            outward = t.double().abs() >= ref.abs()
            inside = torch.nextafter(t, torch.zeros_like(t)).double().abs() < ref.abs()  # the next fp16 inward
            assert outward.all() and (inside | (ref == 0)).all()


def test_a_restart_seeds_the_same_generator_and_zeroes_the_same_counts():
    """A recorded CUDA graph holds a format's random generator and its static scales' counts (:mod:`pace_core.graphs`):
    a restart seeds that generator again and zeroes those counts in place, so the draws after it are the first ones
    again, and the counts start from 0."""
    cfg = static_config("pace-4-static", key_hadamard=True, rounding="stochastic", static_margin=1.5)
    fmt = state_format(cfg, (4,) * HV, cfg.calibrated.layers[0])
    S = 1.6 * snapshots(9, 1)[0].expand(B, HV, K, V).contiguous()
    generator, counts = fmt.generator, fmt._counts
    first = fmt.store(S).codes[4]
    assert fmt.stored == S.numel() and fmt.saturated > 0
    assert not torch.equal(fmt.store(S).codes[4], first)  # the generator advanced
    fmt.restart()
    assert fmt.generator is generator and fmt._counts is counts and (fmt.saturated, fmt.stored) == (0, 0)
    assert torch.equal(fmt.store(S).codes[4], first)


@pytest.mark.parametrize("name, changes", [
    ("pace-4-static", dict(group_size=16)),
    ("rtn-int4", dict(scales="static", symmetric=False, static_margin=1.0)),
    ("pace-4-static", dict(key_hadamard=True, rounding="stochastic", static_margin=1.5)),
])
def test_static_codes_clamp_the_rounding_under_the_calibrated_scales(name, changes):
    """Codes ``clamp(round(x / s) (+ z))`` under ``s`` from the layer's calibrated range widened by the margin:
    symmetric ``s = fp16(margin · amax / qmax)``; zero point ``s = fp16(margin (high − low) / (2^b − 1))``,
    ``z = round(−margin · low / s)``. Values beyond the range saturate, and the format counts them. With stochastic
    rounding the code is one of the two sides (the nearest's reference is then checked on the saturated values
    and the range of the codes)."""
    cfg = static_config(name, **changes)
    ranges = {n.removeprefix("rotated_"): t for n, t in cfg.calibrated.layers[0].items()}
    fmt = state_format(cfg, (4,) * HV, cfg.calibrated.layers[0])
    S = 1.6 * snapshots(9, 1)[0].expand(B, HV, K, V).contiguous()  # beyond the calibrated range in places
    c, values = fmt.store_loaded(S)
    assert isinstance(c, StaticCodes) and set(c.stored_tensors()) == {"codes@4"}  # no scales per sequence
    assert torch.equal(fmt.load(c), values)
    x = torch.einsum("ij,bhjv->bhiv", sylvester(K), S.double()).float().double() if cfg.key_hadamard else S.double()
    xg, dim = _grouped(x, cfg.group_size, cfg.group_axis)
    m = cfg.static_margin
    if cfg.symmetric:
        s = _fp16(m * ranges["amax"].double().unsqueeze(dim) / 7)
        z, low, high = 0.0, -7, 7
    else:
        lo, hi = m * ranges["low"].double().unsqueeze(dim), m * ranges["high"].double().unsqueeze(dim)
        s = _fp16((hi - lo) / 15)
        z, low, high = (-lo / s).round().clamp(0, 15), 0, 15
    y = xg / s + z
    near = y.round()
    saturated = (near < low) | (near > high)
    got = (quant.unpack_codes(c.codes[4], 4, V).double() - (8 if cfg.symmetric else 0)).reshape(xg.shape)
    assert fmt.stored == S.numel() and saturated.any()
    if cfg.rounding == "nearest":
        assert torch.equal(got, near.clamp(low, high)) and fmt.saturated == int(saturated.sum())
    else:  # a stochastic code is one of the two sides: it saturates surely, or possibly
        assert ((got == y.floor().clamp(low, high)) | (got == y.ceil().clamp(low, high))).all()
        assert torch.equal(got[saturated], near.clamp(low, high)[saturated])
        surely, possibly = (y.floor() > high) | (y.ceil() < low), (y.ceil() > high) | (y.floor() < low)
        assert int(surely.sum()) <= fmt.saturated <= int(possibly.sum())
    Y_hat = ((got - z) * s).reshape(x.shape)
    if not cfg.key_hadamard:
        assert torch.equal(values.double(), Y_hat)  # integer codes times an fp16 scale: exact in float32
        return
    want = torch.einsum("ji,bhjv->bhiv", sylvester(K), Y_hat)  # one float32 rounding, two float64 sum orders
    terms = torch.einsum("ji,bhjv->bhiv", sylvester(K).abs(), Y_hat.abs())
    assert ((values.double() - want).abs() <= 2.0**-24 * want.abs() + K * 2.0**-53 * terms).all()


def test_static_scales_of_mixed_widths_follow_each_heads_bits():
    """PACE-4/8 with static scales: a head kept at 8 bits takes the same calibrated range at qmax 255 levels (zero
    point): ``s = fp16(margin (high − low) / 255)``; its codes and the 4-bit heads' are stored apart, the head map
    once."""
    cfg = static_config("pace-4-8", scales="static", high_heads=((1,), (3,)))
    layer = cfg.calibrated.layers[0]
    fmt = state_format(cfg, cfg.head_bits(0, HV), layer)
    S = snapshots(10, 1)[0].expand(B, HV, K, V).contiguous()
    c, values = fmt.store_loaded(S)
    assert set(c.codes) == {4, 8} and c.codes[8].shape == (B, 1, K, V) and torch.equal(fmt.load(c), values)
    xg, dim = _grouped(S[:, 1].double(), cfg.group_size, "key")
    lo = cfg.static_margin * layer["low"][1].double().unsqueeze(dim)
    hi = cfg.static_margin * layer["high"][1].double().unsqueeze(dim)
    s = _fp16((hi - lo) / 255)
    z = (-lo / s).round()
    want = (((xg / s).round() + z).clamp(0, 255) - z) * s
    assert torch.equal(values[:, 1].double(), want.reshape(B, K, V))


def test_static_scales_cost_no_bits_per_sequence():
    """A sequence stores the codes alone; the fp16 ranges (one per group, two with zero points) and two int64
    counts (values stored and saturated) are kept once per layer. A store holds exactly what the accounting
    counts."""
    plain, static = get_config("pace-4"), get_config("pace-4-static")
    groups = SHAPE.num_gdn_layers * HV * K * V // plain.group_size
    assert state_bytes_per_sequence(plain, SHAPE) - state_bytes_per_sequence(static, SHAPE) == 2 * groups
    counts = SHAPE.num_gdn_layers * 2 * 8
    assert state_bytes(static, SHAPE, 1) - state_bytes_per_sequence(static, SHAPE) == 2 * groups + counts
    bits = resident_bits(static, SHAPE)
    assert (bits.code_bits, bits.scale_bits) == (4, 0)
    assert bits.metadata_bits == 16 / plain.group_size + counts * 8 / (SHAPE.num_gdn_layers * HV * K * V)
    zero_point = get_config("pace-4-8").replace(scales="static", high_share=0.0)
    assert state_bytes(zero_point, SHAPE, 1) - state_bytes_per_sequence(zero_point, SHAPE) == 2 * 2 * (
        SHAPE.num_gdn_layers * HV * K * V // zero_point.group_size) + counts
    for cfg in (static_config("pace-4-static"), static_config("pace-4-8", scales="static", high_heads=((1,), (3,)))):
        store = StateStore(cfg, SHAPE, B, "cpu", H, HV, K, V, [0, 2])
        tokens = _tokens(20, seed=11)
        for layer in (0, 2):
            store.prefill(layer, *(x[:, :10] for x in tokens))
            store.decode(layer, *(x[:, 10:] for x in tokens))
        assert held_bytes(store) == state_bytes(cfg, SHAPE, B) == store.nbytes()


def test_static_scales_need_their_calibration():
    """Static scales make RTN and PACE need a calibration (:attr:`Method.calibration` of the settings); a
    calibration of other settings (the other basis, zero points, another grid) is refused by name."""
    cfg = get_config("pace-4-static")
    assert cfg.needs_calibration and not get_config("pace-4").needs_calibration
    assert method_of(cfg).calibration(get_config("pace-4")) is None
    with pytest.raises(PaceError, match="static scales of state are not calibrated"):
        state_format(cfg, (4,) * HV)
    done = static_config("pace-4-static")
    assert not done.needs_calibration and done.validate_for(SHAPE) is done
    for other in (dict(key_hadamard=True), dict(symmetric=False), dict(group_size=32)):
        with pytest.raises(PaceError, match="not the static scales' ranges of these settings"):
            done.replace(**other).validate_for(SHAPE)
    with pytest.raises(PaceError, match="calibrated is set for method 'pace' with these settings"):
        done.replace(scales="dynamic")


def _tokens(T: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k = prepare_qk(torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen))
    v = torch.randn(B, T, HV, V, generator=gen)
    g = torch.empty(B, T, HV).uniform_(0.9, 0.999, generator=gen).log()
    return q, k, v, g, torch.rand(B, T, HV, generator=gen)
