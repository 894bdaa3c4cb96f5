"""Tests of pace_core.state_store: prefill / decode orchestration, bytes, reorder, errors."""

import pytest
import torch
import torch.nn.functional as F
from calibration_support import calibrated as random_calibration
from numerics import fp32_bound
from references import per_token_decode, periodic_decode, segmented_prefill

from pace_core import quant
from pace_core.accounting import host_bytes, state_bytes, transient_bytes
from pace_core.config import NAMED_CONFIGS, PaceConfig, get_config
from pace_core.errors import PaceError
from pace_core.memory import PeakBytes, held_bytes
from pace_core.methods.dsq import dsq_dequantize, dsq_quantize
from pace_core.recurrence import gdn_recurrent, prepare_qk
from pace_core.shapes import ModelShape, get_shape
from pace_core.state_store import StateStore

pytestmark = pytest.mark.numerics

B, H, GAMMA, K, V = 2, 2, 2, 64, 32
HV = H * GAMMA
LAYERS = [0, 2]


def make_tokens(T, seed, batch=B, alpha=(0.9, 0.999)):
    """Prepared GDN inputs in float32: q, k [b, T, H, K], v [b, T, HV, V], g, beta [b, T, HV]."""
    gen, cpu = torch.Generator().manual_seed(seed), dict(device="cpu")  # CPU draws, also where CUDA is the default
    q, k = prepare_qk(
        torch.randn(batch, T, H, K, generator=gen, **cpu), torch.randn(batch, T, H, K, generator=gen, **cpu)
    )
    v = torch.randn(batch, T, HV, V, generator=gen, **cpu)
    g = torch.empty(batch, T, HV, **cpu).uniform_(*alpha, generator=gen).log()
    beta = torch.rand(batch, T, HV, generator=gen, **cpu)
    return q, k, v, g, beta


def split(tokens, start, stop=None):
    return [x[:, start:stop] for x in tokens]


def calibrated(cfg, seed=0):
    """``cfg`` with a random calibration of its method's tensors for this file's store (tests/calibration_support)."""
    return random_calibration(cfg, HV, K, len(LAYERS), seed, d_v=V)


def store_for(name, batch=B, **changes):
    cfg = get_config(name).replace(**changes) if changes else get_config(name)
    return StateStore(calibrated(cfg), None, batch, "cpu", H, HV, K, V, LAYERS)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_fp32_reference_equals_recurrence():
    tokens = make_tokens(40, seed=1)
    store = store_for("fp32")
    o_pre = store.prefill(2, *split(tokens, 0, 30))
    o_dec = store.decode(2, *split(tokens, 30))
    o_ref, S_ref = gdn_recurrent(*(x.double() for x in tokens))
    assert rel(torch.cat([o_pre, o_dec], 1), o_ref) < 1e-5
    assert rel(store.effective_state(2), S_ref) < 1e-5
    assert store.buffer(2) is None
    # the other layer is untouched
    assert torch.equal(store.effective_state(0), torch.zeros(B, HV, K, V))


def test_bf16_reference_rounds_every_token():
    tokens = make_tokens(20, seed=2)
    store = store_for("bf16")
    store.prefill(0, *split(tokens, 0, 12))
    outs = [store.decode(0, *split(tokens, t, t + 1)) for t in range(12, 20)]
    # reference: whole prompt in float64, state stored as bf16, then one bf16 rounding per token
    _, S = gdn_recurrent(*(x.double() for x in split(tokens, 0, 12)))
    S = S.bfloat16().double()
    o_ref = []
    for t in range(12, 20):
        o_t, S = gdn_recurrent(*(x.double() for x in split(tokens, t, t + 1)), S)
        S = S.bfloat16().double()
        o_ref.append(o_t)
    assert rel(torch.cat(outs, 1), torch.cat(o_ref, 1)) < 1e-5
    assert torch.equal(store.checkpoint_dequantized(0).double(), S)
    assert store.layer(0).checkpoint.dtype == torch.bfloat16


@pytest.mark.parametrize("reference_dtype,bits", [("float32", 32), ("bfloat16", 16)])
def test_reference_with_buffering(reference_dtype, bits):
    """Method none with dP = 4: the float32 store equals the plain recurrence (quantisation off,
    buffering on); the bfloat16 store casts at each prefill-segment end and each flush."""
    cfg = get_config("fp32").replace(reference_dtype=reference_dtype, bits=bits, decode_period=4,
                                     buffer="fp32", prefill_period=8)
    store = StateStore(cfg, None, B, "cpu", H, HV, K, V, LAYERS)
    tokens = make_tokens(30, seed=12)
    assert not store.has_state(0)
    o = torch.cat([store.prefill(0, *split(tokens, 0, 19)), store.decode(0, *split(tokens, 19))], 1)
    assert store.has_state(0) and not store.has_state(2)
    assert len(store.buffer(0)) == 3
    if reference_dtype == "float32":
        o_ref, S_ref = gdn_recurrent(*(x.double() for x in tokens))
        assert rel(o, o_ref) < 1e-5 and rel(store.effective_state(0), S_ref) < 1e-5
    else:
        def cast(S):
            return S.bfloat16().to(S.dtype)
        o_pre, S_pre = segmented_prefill(*split(tokens, 0, 19), torch.zeros(B, HV, K, V), 8, cast)
        o_dec, S_ref, _ = periodic_decode(*split(tokens, 19), S_pre, 4, cast, "fp32")
        assert torch.equal(o, torch.cat([o_pre, o_dec], 1))  # the same functions in the same order
        assert rel(store.effective_state(0), S_ref) < 1e-6
        assert store.layer(0).checkpoint.dtype == torch.bfloat16
    store.reset()
    assert not store.has_state(0)


@pytest.mark.parametrize("name", ["pace-4", "rtn-int4", "qmamba-dsq"])
def test_quantised_pipeline_matches_composition(name):
    """Prefill in P-token segments rounded at each end, then decode with a flush every dP tokens
    through a buffer in the config's precision, equals the same composition of the tested
    recurrence functions."""
    cfg = get_config(name).replace(prefill_period=16)
    store = StateStore(cfg, None, B, "cpu", H, HV, K, V, LAYERS)
    if cfg.method == "dsq":
        def round_fn(S):
            return dsq_dequantize(dsq_quantize(S, cfg.bits)).to(S.dtype)
    else:
        def round_fn(S):
            return quant.fake_quantize(S, cfg.quant_spec())
    tokens = make_tokens(61, seed=3)
    o_pre = store.prefill(0, *split(tokens, 0, 40))
    o_dec = store.decode(0, *split(tokens, 40))
    o_pre_ref, S_pre = segmented_prefill(*split(tokens, 0, 40), torch.zeros(B, HV, K, V), 16, round_fn)
    if cfg.buffered:
        o_dec_ref, S_ref, _ = periodic_decode(*split(tokens, 40), S_pre, cfg.decode_period, round_fn, cfg.buffer)
    else:  # per-token rounding: one plain recurrence step, then the rounding
        o_dec_ref, S_ref = per_token_decode(*split(tokens, 40), S_pre, round_fn)
    # the same functions in the same order: bit for bit (a rounding after another summation order could
    # flip a code, and one flipped 4-bit code is far beyond float32 rounding)
    assert torch.equal(o_pre, o_pre_ref) and torch.equal(o_dec, o_dec_ref)
    assert torch.equal(store.effective_state(0), S_ref)
    expected_len = 21 % cfg.decode_period if cfg.buffered else None
    assert (store.buffer(0) is None) == (not cfg.buffered)
    if cfg.buffered:
        assert len(store.buffer(0)) == expected_len


def test_prefill_after_decode():
    """A prompt after 3 decoded tokens: ``flush`` rounds the checkpoint plus folded buffer first, ``carry``
    runs the prompt from that state unrounded; either way the buffer is empty after it."""
    tokens = make_tokens(30, seed=4)
    spec = get_config("pace-4").quant_spec()
    outputs = {}
    for after in ("flush", "carry"):
        store = store_for("pace-4", prefill_after_decode=after)
        store.prefill(0, *split(tokens, 0, 10))
        store.decode(0, *split(tokens, 10, 13))
        assert len(store.buffer(0)) == 3
        folded = store.effective_state(0)
        outputs[after] = o = store.prefill(0, *split(tokens, 13))
        assert len(store.buffer(0)) == 0
        start = quant.fake_quantize(folded, spec) if after == "flush" else folded
        o_ref, S_ref = segmented_prefill(*split(tokens, 13), start, 256, lambda S: quant.fake_quantize(S, spec))
        assert torch.equal(o, o_ref) and torch.equal(store.checkpoint_dequantized(0), S_ref)
    assert rel(outputs["carry"], outputs["flush"]) > 1e-4  # the flush's extra rounding shows


@pytest.mark.parametrize("after", ["flush", "carry"])
def test_empty_prompt_after_decode(after):
    """``flush`` flushes even for an empty prompt (as before the setting); ``carry`` leaves the state as it
    is, buffer included."""
    store = store_for("pace-4", prefill_after_decode=after)
    tokens = make_tokens(13, seed=5)
    store.prefill(0, *split(tokens, 0, 10))
    store.decode(0, *split(tokens, 10, 13))
    before = store.checkpoint_dequantized(0)
    o = store.prefill(0, *split(tokens, 13, 13))
    assert o.shape == (B, 0, HV, V)
    assert len(store.buffer(0)) == (3 if after == "carry" else 0)
    assert torch.equal(store.checkpoint_dequantized(0), before) == (after == "carry")


def test_carry_keeps_the_buffer_when_the_prompt_fails():
    """A prompt whose state turns non-finite is refused before anything is stored: under ``carry`` the
    decoded tokens stay in the buffer, on the checkpoint they were decoded from."""
    store = store_for("pace-4", prefill_after_decode="carry")
    tokens = make_tokens(20, seed=6)
    store.prefill(0, *split(tokens, 0, 10))
    store.decode(0, *split(tokens, 10, 13))
    before = store.effective_state(0)
    q, k, v, g, beta = split(tokens, 13)
    v = v.clone()
    v[0, 2, 1, 5] = float("nan")
    with pytest.raises(PaceError, match="non-finite"):
        store.prefill(0, q, k, v, g, beta)
    assert len(store.buffer(0)) == 3
    assert torch.equal(store.effective_state(0), before)


def test_periodic_rounding_lowers_state_error():
    """Synthetic run with realistic decays (α = exp(-softplus(a)) in ~0.9..0.999): after N decode
    tokens the 4-bit key-axis (g = 32) state error is lower at dP = 8 than at dP = 1."""
    gen = torch.Generator().manual_seed(5)
    T0, N = 64, 64
    q, k = prepare_qk(torch.randn(B, T0 + N, H, K, generator=gen), torch.randn(B, T0 + N, H, K, generator=gen))
    v = torch.randn(B, T0 + N, HV, V, generator=gen)
    g = -F.softplus(torch.empty(B, T0 + N, HV).uniform_(-6.9, -2.3, generator=gen))
    beta = torch.sigmoid(torch.randn(B, T0 + N, HV, generator=gen))
    tokens = (q, k, v, g, beta)
    _, S_ref = gdn_recurrent(*(x.double() for x in tokens))
    errors = {}
    for dP in (1, 8):
        cfg = get_config("pace-4").replace(group_size=32, decode_period=dP)
        store = StateStore(cfg, None, B, "cpu", H, HV, K, V, LAYERS)
        store.prefill(0, *split(tokens, 0, T0))
        store.decode(0, *split(tokens, T0))
        errors[dP] = rel(store.effective_state(0), S_ref)
    assert 0 < errors[8] < errors[1]


def test_per_head_bits():
    cfg = get_config("pace-4-8").replace(high_heads=((1,), (0,)))
    store = StateStore(cfg, None, B, "cpu", H, HV, K, V, LAYERS)
    assert store.bits_per_head(0) == (4, 8, 4, 4) and store.bits_per_head(2) == (8, 4, 4, 4)
    tokens = make_tokens(24, seed=6)
    store.prefill(0, *tokens)
    _, S = gdn_recurrent(*tokens)
    err = (store.checkpoint_dequantized(0) - S).square().sum((0, 2, 3)) / S.square().sum((0, 2, 3))
    assert float(err[1]) * 64 < float(err[[0, 2, 3]].min())  # 8-bit head: ~256x less error energy
    parts = store.layer(0).checkpoint.parts
    assert sorted(parts) == [4, 8]
    with pytest.raises(PaceError, match="high_heads"):
        StateStore(get_config("pace-4-8"), None, B, "cpu", H, HV, K, V, LAYERS)


def expected_bytes(name):
    """(payload, metadata, buffer) per layer from the storage formats, B=2, HV=4, K=64, V=32."""
    n = B * HV * K * V
    if name == "fp32":
        return 4 * n, 0, 0
    if name == "bf16":
        return 2 * n, 0, 0
    if name == "rtn-int4":  # value axis g 32, fp16 scales
        return n // 2, 2 * n // 32, 0
    if name == "pace-4":  # key axis g 64; int8 buffer of 8 records: keys, values, fp32 decays, fp16 scales
        record = H * K + HV * V + 4 * HV + 2 * (H + HV)
        return n // 2, 2 * n // 64, 8 * B * record
    if name == "pace-4-8":  # heads 1 (layer 0) at 8 bits; g 32 key axis with fp16 scale + zero point; the
        low, high = 3 * n // 4, n // 4  # head map: one int16 per head, once for the batch
        groups_low, groups_high = low // 32, high // 32
        # mixed: 4-bit keys in groups of 16, each with an fp16 scale and a 4-bit zero point (packed), bf16 values
        record = H * (K // 2 + 2 * K // 16 + K // 32) + HV * V * 2 + 4 * HV
        return (low // 2 + high, 2 * (groups_low + groups_high) + groups_low // 2 + groups_high + 2 * HV,
                8 * B * record)
    if name == "qmamba-dsq":  # codes + row scales [B, HV, K] + column scales [B, HV, V]
        return n // 2, 2 * B * HV * (K + V), 0
    if name == "damp-int4":  # 16 fp16 rows + 48 4-bit rows with fp16 scales (value axis g 32) + int16 rows
        rest = B * HV * 48 * V
        return 2 * B * HV * 16 * V + rest // 2, 2 * rest // 32 + 2 * HV * 16, 0
    raise KeyError(name)


@pytest.mark.parametrize("name", ["fp32", "bf16", "rtn-int4", "pace-4", "pace-4-8", "qmamba-dsq", "damp-int4"])
def test_byte_counts(name):
    changes = {"high_heads": ((1,), (0,))} if name == "pace-4-8" else {}
    store = store_for(name, **changes)
    tokens = make_tokens(12, seed=7)
    store.prefill(0, *split(tokens, 0, 9))
    store.decode(0, *split(tokens, 9))
    payload, metadata, buffer = expected_bytes(name)
    sizes = store.layer_nbytes(0)
    assert sizes == {"payload": payload, "metadata": metadata, "buffer": buffer}
    layer = store.layer(0)
    checkpoint = layer.checkpoint
    if isinstance(checkpoint, torch.Tensor):
        assert payload == checkpoint.numel() * checkpoint.element_size()
    elif name == "damp-int4":
        assert payload + metadata == checkpoint.nbytes() == layer.fmt.quantizer.nbytes((B, HV, K, V))
    else:
        assert payload + metadata == checkpoint.nbytes()
    if layer.buffer is not None:
        assert buffer == sum(t.numel() * t.element_size() for t in layer.buffer.storage().values())
    assert store.nbytes() == sum(sum(store.layer_nbytes(i).values()) for i in LAYERS)


@pytest.mark.parametrize("name", ["fp32", "pace-4", "pace-4-8", "qmamba-dsq", "damp-int4"])
def test_reorder(name):
    changes = {"high_heads": ((1,), (0,))} if name == "pace-4-8" else {}
    store = store_for(name, batch=3, **changes)
    tokens = make_tokens(13, seed=8, batch=3)
    store.prefill(2, *split(tokens, 0, 10))
    store.decode(2, *split(tokens, 10))
    before = store.effective_state(2)
    checkpoint_before = store.checkpoint_dequantized(2)
    store.reorder(torch.tensor([2, 0, 0]))
    assert torch.equal(store.effective_state(2), before[[2, 0, 0]])
    assert torch.equal(store.checkpoint_dequantized(2), checkpoint_before[[2, 0, 0]])
    with pytest.raises(PaceError, match="beam_idx"):
        store.reorder(torch.tensor([0, 3, 1]))


def test_reset():
    store = store_for("pace-4")
    store.prefill(0, *make_tokens(11, seed=9))
    store.decode(0, *make_tokens(2, seed=10))
    sizes = store.layer_nbytes(0)
    store.reset()
    assert torch.equal(store.effective_state(0), torch.zeros(B, HV, K, V))
    assert len(store.buffer(0)) == 0 and store.layer_nbytes(0) == sizes


@pytest.mark.parametrize("name", ["fp32", "pace-4", "rtn-int4"])
def test_non_finite_state_raises(name):
    store = store_for(name)
    q, k, v, g, beta = make_tokens(5, seed=11)
    v[0, 2, 1, 3] = float("inf")
    with pytest.raises(PaceError, match="non-finite"):
        store.prefill(0, q, k, v, g, beta)
    store.reset()
    v[0, 2, 1, 3] = float("nan")
    with pytest.raises(PaceError, match="non-finite"):
        store.decode(0, q, k, v, g, beta)


def test_bad_input_raises():
    cfg = get_config("pace-4")
    with pytest.raises(PaceError, match="layer"):
        store_for("pace-4").decode(1, *make_tokens(1, seed=0))
    with pytest.raises(PaceError, match="v:"):
        q, k, v, g, beta = make_tokens(3, seed=0)
        store_for("pace-4").prefill(0, q, k, v[:, :, :2], g, beta)
    with pytest.raises(PaceError, match="not calibrated on the model"):
        StateStore(get_config("damp-int4"), None, B, "cpu", H, HV, K, V, LAYERS)
    with pytest.raises(PaceError, match="high_heads"):
        StateStore(get_config("pace-4-8").replace(high_heads=((1,),)), None, B, "cpu", H, HV, K, V, LAYERS)
    with pytest.raises(PaceError, match="high_heads"):
        StateStore(get_config("pace-4-8").replace(high_heads=((1,), (7,))), None, B, "cpu", H, HV, K, V, LAYERS)
    with pytest.raises(PaceError, match="group_size"):
        StateStore(cfg.replace(group_size=128), None, B, "cpu", H, HV, K, V, LAYERS)
    shape = ModelShape("toy", 4, 2, H, HV, K, 2 * V, 1000)
    with pytest.raises(PaceError, match="d_v"):
        StateStore(cfg, shape, B, "cpu", H, HV, K, V, LAYERS)
    with pytest.raises(PaceError, match="one device per GDN layer"):
        StateStore(cfg, None, B, {LAYERS[0]: "cpu"}, H, HV, K, V, LAYERS)


def test_a_layer_with_every_head_promoted_stores_8_bit_codes():
    cfg = get_config("pace-4-8").replace(high_share=1.0, high_heads=((0, 1, 2, 3), (0, 1, 2, 3)))
    store = StateStore(cfg, None, B, "cpu", H, HV, K, V, LAYERS)
    tokens = make_tokens(20, seed=int(torch.randint(0, 2**31, ())))
    store.prefill(0, *tokens)
    assert store.bits_per_head(0) == (8,) * HV
    spec = quant.QuantSpec(bits=8, symmetric=False, axis="key", group_size=32)
    assert store.layer(0).checkpoint.spec == spec
    nbytes = store.layer_nbytes(0)
    assert nbytes["payload"] + nbytes["metadata"] == quant.packed_nbytes((B, HV, K, V), spec)
    _, S_ref = gdn_recurrent(*(x.double() for x in tokens))
    assert rel(store.checkpoint_dequantized(0), S_ref) < 0.01  # 8-bit error level; 4-bit codes give ~0.1


KERNEL_CASES = {
    # name: config (dP 4 to keep the interpreter quick); pace-4/pace-4-8 take the split kernel path,
    # value-axis rtn and fp32 the fused one
    "pace-4": get_config("pace-4").replace(decode_period=4, group_size=32),
    "pace-4-8": get_config("pace-4-8").replace(decode_period=4, high_heads=((1,),)),
    "rtn-value": get_config("rtn-int4").replace(decode_period=4, buffer="int8"),
    "fp32": get_config("fp32").replace(decode_period=4, buffer="fp32"),
    "bf16 per-token": get_config("bf16"),  # dP 1: the dense per-token kernel, state in place
}


def _kernel_tolerance(rounding: float, tokens: int, K: int) -> float:
    """How far the kernels may be from the reference: float32 rounding of the recurrence (dots of length
    K through ``tokens`` tokens), or, where the state is rounded to few bits, a fifth of that rounding's
    own error against the exact recurrence: the two float paths put a few values on the other side of a
    rounding boundary (one code step each, smaller than the rounding error of that entry), while a wiring
    slip is off by the whole rounding error or more."""
    return max(fp32_bound(4 * tokens * K), 0.2 * rounding)


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_decode_on_the_kernels_follows_the_reference(name, monkeypatch):
    """Buffered decode routed to the Triton kernels (interpreted here) against the reference path,
    over two flushes after a prefill; any wiring slip (inputs, the in-place checkpoint, the flush)
    would be off by far more than the records' one-code differences allow. The launch plan is made
    once per checkpoint."""
    from kernels_support import kernel_modules

    backend = kernel_modules()["backend"]  # the interpreter, as for the kernels' own tests
    plans = []
    make_plan = backend.plan_decode
    monkeypatch.setattr(backend, "plan_decode", lambda *a: plans.append(1) or make_plan(*a))
    from pace_core.state_store import LayerState

    cfg = KERNEL_CASES[name]
    B, Hk, Hv, K, V = 2, 2, 4, 64, 32
    layers = {b: LayerState(cfg, B, Hk, Hv, K, V, "cpu", backend=b) for b in ("triton", "reference")}
    assert layers["triton"].uses_kernels() and not layers["reference"].uses_kernels()
    T0, T = 6, 2 * max(cfg.decode_period, 2) + 1
    q, k = prepare_qk(torch.randn(B, T0 + T, Hk, K), torch.randn(B, T0 + T, Hk, K))
    v, g, beta = torch.randn(B, T0 + T, Hv, V), -torch.rand(B, T0 + T, Hv) * 0.5, torch.rand(B, T0 + T, Hv)
    pre, dec = slice(0, T0), slice(T0, T0 + T)
    outs = {}
    for b, layer in layers.items():
        layer.prefill(q[:, pre], k[:, pre], v[:, pre], g[:, pre], beta[:, pre])
        outs[b] = layer.decode(q[:, dec], k[:, dec], v[:, dec], g[:, dec], beta[:, dec])
    assert outs["triton"].shape == (B, T, Hv, V)
    o64, S64 = gdn_recurrent(*(x.double() for x in (q, k, v, g, beta)))  # the exact recurrence, no rounding
    S_tri, S_ref = layers["triton"].effective_state(), layers["reference"].effective_state()
    assert rel(outs["triton"], outs["reference"]) < _kernel_tolerance(rel(outs["reference"], o64[:, dec]), T0 + T, K)
    if cfg.decode_period > 1:
        assert len(layers["triton"].buffer) == len(layers["reference"].buffer) == 1
    assert type(layers["triton"].checkpoint) is type(layers["reference"].checkpoint)
    assert rel(S_tri, S_ref) < _kernel_tolerance(rel(S_ref, S64), T0 + T, K)

    assert len(plans) == (1 if cfg.decode_period > 1 else 0)
    bad = v[:, dec].clone()
    bad[0, 1, 2, 3] = float("nan")
    with pytest.raises(PaceError, match="non-finite"):
        layers["triton"].decode(q[:, dec], k[:, dec], bad, g[:, dec], beta[:, dec])


def test_kernel_backend_setting(monkeypatch):
    from pace_core.backend import backend_setting
    from pace_core.state_store import LayerState

    monkeypatch.setenv("PACE_KERNELS", "reference")
    assert backend_setting() == "reference"
    cfg = get_config("pace-4").replace(group_size=32)
    assert not LayerState(cfg, 1, 1, 2, 64, 32, "cpu").uses_kernels()
    monkeypatch.setenv("PACE_KERNELS", "fast")
    with pytest.raises(PaceError, match="PACE_KERNELS"):
        LayerState(cfg, 1, 1, 2, 64, 32, "cpu")
    monkeypatch.delenv("PACE_KERNELS")
    assert not LayerState(cfg, 1, 1, 2, 64, 32, "cpu").uses_kernels()  # auto: CPU tensors use the reference
    assert not LayerState(get_config("qmamba-dsq").replace(decode_period=4), 1, 1, 2, 64, 32, "cpu",
                          backend="triton").uses_kernels()  # no kernel for DSQ


RESIDENT_SHAPE = ModelShape("residency", 3, 2, H, HV, K, V, 0, gdn_layers=(0, 2))


def resident_store(name: str | PaceConfig, backend: str, device: str | torch.device = "cpu") -> StateStore:
    """A store of named configuration ``name`` (or a configuration) at :data:`RESIDENT_SHAPE` (PACE-4/8 with one
    8-bit head per layer, DAMP with random outlier rows) after a prefill and decode tokens through a flush and into
    the next buffer."""
    cfg = get_config(name) if isinstance(name, str) else name
    if cfg.high_share > 0:
        cfg = cfg.replace(high_heads=((1,), (3,)))
    store = StateStore(calibrated(cfg), RESIDENT_SHAPE, B, device, H, HV, K, V, LAYERS, backend=backend)
    tokens = [t.to(device) for t in make_tokens(5 + cfg.decode_period + 2, seed=3)]
    for layer in LAYERS:
        store.prefill(layer, *split(tokens, 0, 5))
        store.decode(layer, *split(tokens, 5, 7))
        for t in range(7, tokens[0].shape[1]):  # one token per call, as generate() does
            store.decode(layer, *split(tokens, t, t + 1))
        store.effective_state(layer)
    return store


@pytest.mark.parametrize("name", list(NAMED_CONFIGS))
def test_resident_bytes_are_the_accounted_bytes(name):
    """Every tensor a store holds after a prefill and decode (the reference backend) is what
    pace_core.accounting.state_bytes counts: no dequantised checkpoint, fp32 copy of the buffer or earlier
    checkpoint outlives a call."""
    store = resident_store(name, "reference")
    assert held_bytes(store) == state_bytes(store.cfg, RESIDENT_SHAPE, B) == store.nbytes()


WIDTH_VARIANTS = {
    "rtn zero point": lambda b: get_config(f"rtn-int{b}").replace(symmetric=False),  # value axis: rows padded
    "pace": lambda b: get_config("pace-4").replace(bits=b, group_size=32),
    "pace 8-bit heads": lambda b: get_config("pace-4-8").replace(bits=b),
    "pace static": lambda b: get_config("pace-4-static").replace(bits=b),
    "damp": lambda b: get_config("damp-int4").replace(bits=b),
    "dsq": lambda b: get_config("qmamba-dsq").replace(bits=b),
}
"""Each method's storage at any width (issue 48: every width packed densely; STEPQuant's widths 2/4/6/8 and pivots
are its named configurations'), with its zero points, 8-bit heads and static scales where it has them."""


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("variant", list(WIDTH_VARIANTS))
def test_resident_bytes_are_the_accounted_bytes_at_every_width(variant, bits):
    """Held = counted for every code width of every method: the densely packed codes and zero points a store holds
    after a prefill and decode through a flush are the bytes pace_core.accounting counts (its rows padded only to a
    whole byte)."""
    store = resident_store(WIDTH_VARIANTS[variant](bits), "reference")
    assert held_bytes(store) == state_bytes(store.cfg, RESIDENT_SHAPE, B) == store.nbytes()


@pytest.mark.parametrize("name", list(NAMED_CONFIGS))
@pytest.mark.parametrize("tokens", [5, 40, 300])
def test_peak_transient_is_within_the_stated_bound(name, tokens):
    """The workspace of a prefill of ``tokens`` tokens and of single-token decode calls (their peak allocation
    beyond the state, pace_core.memory.PeakBytes; the outputs deleted after the prefill, kept during it) stays
    within pace_core.accounting.transient_bytes, and the store holds only its accounted bytes after each."""
    cfg = get_config(name)
    if cfg.high_share > 0:
        cfg = cfg.replace(high_heads=((1,), (3,)))
    store = StateStore(calibrated(cfg), RESIDENT_SHAPE, B, "cpu", H, HV, K, V, LAYERS)
    tokens_ = make_tokens(tokens + cfg.decode_period + 1, seed=4)
    with PeakBytes() as prefill:
        store.prefill(0, *split(tokens_, 0, tokens))
    assert 0 < prefill.peak <= transient_bytes(cfg, RESIDENT_SHAPE, B, tokens, prefill=True)
    for t in range(tokens, tokens_[0].shape[1]):  # through a flush
        with PeakBytes() as decode:
            store.decode(0, *split(tokens_, t, t + 1))
        assert 0 < decode.peak <= transient_bytes(cfg, RESIDENT_SHAPE, B)
        assert held_bytes(store) == state_bytes(store.cfg, RESIDENT_SHAPE, B)


def test_stochastic_rounding_keeps_its_generator_outside_the_state():
    """pace-4-sr's generators live in each layer's format on the host (StateFormat.generator), one per GDN layer:
    not tensors, so neither the bytes held nor state_bytes hold them; accounting.host_bytes counts them (issue 46:
    they were counted nowhere), 121,344 B at Qwen3.5-4B's 24 GDN layers on the CPU."""
    store = resident_store("pace-4-sr", "reference")
    generators = [store.layer(layer).fmt.generator for layer in LAYERS]
    assert all(isinstance(g, torch.Generator) and g.device == torch.device("cpu") for g in generators)
    assert sum(g.get_state().numel() for g in generators) == host_bytes(store.cfg, RESIDENT_SHAPE) == 2 * 5056
    assert held_bytes(store) == state_bytes(store.cfg, RESIDENT_SHAPE, B)
    assert host_bytes(get_config("pace-4-sr"), get_shape("qwen3.5-4b")) == 121_344
    assert all(host_bytes(get_config(name), RESIDENT_SHAPE) == 0 for name in NAMED_CONFIGS if name != "pace-4-sr")
