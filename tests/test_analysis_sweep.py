import math

import pytest
import torch

from pace_core.analysis import sweep as sweep_module
from pace_core.analysis.sweep import GDNInputs, grid_configs, record_gdn_inputs, sweep, sweep_states
from pace_core.checkpoint import RoundingFormat
from pace_core.config import get_config
from pace_core.errors import PaceError
from pace_core.model.capture import run_with_states
from pace_core.model.loading import load_model
from pace_core.quant import fake_quantize
from pace_core.recurrence import gdn_chunked, gdn_recurrent, prepare_qk
from pace_core.state_store import LayerState

pytestmark = pytest.mark.numerics


def _inputs(L=2, T=48, H=1, HV=2, K=32, V=32, decay=0.01):
    q, k = prepare_qk(torch.randn(L, T, H, K), torch.randn(L, T, H, K))
    return GDNInputs(list(range(L)), q, k, torch.randn(L, T, HV, V), -decay * torch.rand(L, T, HV),
                     torch.rand(L, T, HV))


def _layer_state_final(inp, cfg, D):
    """Independent path: H-rec's LayerState prefill + decode, one layer at a time."""
    L, T, H, K = inp.q.shape
    HV, V = inp.v.shape[2:]
    out = []
    for layer in range(L):
        st = LayerState(cfg, 1, H, HV, K, V, "cpu")
        x = [t[layer : layer + 1] for t in (inp.q, inp.k, inp.v, inp.g, inp.beta)]
        st.prefill(*(t[:, :D] for t in x))
        st.decode(*(t[:, D:] for t in x))
        out.append(st.effective_state())
    return torch.cat(out)


def test_sweep_states_matches_layer_state_and_float64_reference():
    inp = _inputs()
    base = get_config("pace-4").replace(prefill_period=16)
    cfgs = [base.replace(name="a", bits=4, decode_period=1, group_size=32),
            base.replace(name="b", bits=4, decode_period=8, group_axis="value", group_size=16),
            base.replace(name="c", bits=8, decode_period=8, buffer="fp32", symmetric=False, group_size=32)]
    summary, steps = sweep_states(inp, cfgs, decode_tokens=24)
    _, S_ref = gdn_recurrent(*(t.double() for t in (inp.q, inp.k, inp.v, inp.g, inp.beta)))
    for i, cfg in enumerate(cfgs):
        S = _layer_state_final(inp, cfg, 24).double()
        want = float(torch.linalg.norm(S - S_ref) / torch.linalg.norm(S_ref))
        assert summary.iloc[i]["config"] is cfg
        assert summary.iloc[i]["final_rel_error"] == pytest.approx(want, rel=2e-2)
    assert list(steps[steps.config == "a"].step) == [0, 8, 16, 24]
    assert (summary.final_rel_error > 0).all() and (summary.output_rel_error > 0).all()


def test_sweep_ordering_on_long_decays():
    inp = _inputs(T=96, decay=0.005)
    cfgs = grid_configs(bits=(4, 8), periods=(1, 8), axes=("key",), group_sizes=(32,),
                        base=get_config("pace-4").replace(prefill_period=32))
    summary, _ = sweep_states(inp, cfgs, decode_tokens=64)
    err = dict(zip([c.name for c in summary.config], summary.mean_rel_error))
    assert err["b4-dP1-key-g32"] > err["b4-dP8-key-g32"] > err["b8-dP8-key-g32"] > 0
    assert err["b4-dP1-key-g32"] > err["b8-dP1-key-g32"]
    with pytest.raises(PaceError, match="record_every"):
        sweep_states(inp, cfgs, decode_tokens=64, record_every=12)
    with pytest.raises(PaceError, match="not allowed in a sweep"):
        sweep_states(inp, [get_config("pace-4-8")], decode_tokens=8)
    for name in ("pace-4-sr", "pace-4-hadamard", "pace-4-static"):  # its rounding function is the plain quantiser's
        with pytest.raises(PaceError, match="not allowed in a sweep.*without combinations"):
            sweep_states(inp, [get_config(name)], decode_tokens=8)


def test_recorded_inputs_reproduce_the_model_state(tiny_checkpoints):
    m = load_model(tiny_checkpoints["qwen3_5_text"])
    ids = torch.randint(3, 100, (1, 40))
    inp = record_gdn_inputs(m, ids)
    ref = run_with_states(m, get_config("fp32"), ids, capture_steps=[40])
    _, S = gdn_recurrent(inp.q, inp.k, inp.v, inp.g, inp.beta)
    for i, layer in enumerate(m.gdn_layers):
        torch.testing.assert_close(S[i : i + 1], ref.states[40][layer], rtol=1e-4, atol=1e-5)
    summary, steps = sweep(m, ids, grid_configs(bits=(4,), periods=(1, 8), axes=("key", "value")), decode_tokens=16)
    assert list(summary.config) == ["b4-dP1-key-g32", "b4-dP1-value-g32", "b4-dP8-key-g32", "b4-dP8-value-g32"]
    assert (summary.resident_bits > 4).all() and math.isfinite(summary.mean_rel_error.sum())


def test_whole_prompt_prefill_is_the_rounded_reference_state():
    inp = _inputs(T=40)
    base = get_config("pace-4").replace(group_size=32, decode_period=8)
    one_segment = [base.replace(name="P24", prefill_period=24), base.replace(name="Pbig", prefill_period=4096)]
    summary, _ = sweep_states(inp, one_segment, decode_tokens=16)
    assert summary.final_rel_error[0] == summary.final_rel_error[1]
    assert summary.prefill_rel_error[0] == summary.prefill_rel_error[1] > 0
    segmented, _ = sweep_states(inp, [base.replace(name="P8", prefill_period=8)], decode_tokens=16)
    assert segmented.prefill_rel_error[0] != summary.prefill_rel_error[0]



def test_a_float64_sweep_keeps_float64_checkpoints(monkeypatch):
    """A sweep of float64 inputs keeps its checkpoints in float64 (issue 46: they were float32, the default of
    RoundingFormat), and its errors are those of the float64 recurrence rounded at every token, to float64's
    rounding over these few steps."""
    made = []

    def recording(*args, **kwargs):
        made.append(RoundingFormat(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(sweep_module, "RoundingFormat", recording)
    inp = _inputs(T=40)
    inp = GDNInputs(inp.layers, *(t.double() for t in (inp.q, inp.k, inp.v, inp.g, inp.beta)))
    cfgs = [get_config("pace-4").replace(name="a", bits=8, group_size=32, decode_period=1, prefill_period=16),
            get_config("pace-4").replace(name="b", bits=4, group_size=32, decode_period=1, prefill_period=4096)]
    summary, _ = sweep_states(inp, cfgs, decode_tokens=16)
    assert made and {f.dtype for f in made} == {torch.float64}
    spec = cfgs[1].quant_spec()
    _, S = gdn_chunked(*inp.part(slice(0, 24)))
    want = float(torch.linalg.norm(fake_quantize(S, spec) - S) / torch.linalg.norm(S))
    assert summary.prefill_rel_error[1] == pytest.approx(want, rel=1e-12)
    S_dec = fake_quantize(S, spec)
    for t in range(24, 40):  # per-token rounding, every step's state float64
        _, S_dec = gdn_chunked(*inp.part(slice(t, t + 1)), S_dec)
        S_dec = fake_quantize(S_dec, spec)
    _, S_ref = gdn_chunked(*inp.part(slice(0, 40)))
    want = float(torch.linalg.norm(S_dec - S_ref) / torch.linalg.norm(S_ref))
    assert summary.final_rel_error[1] == pytest.approx(want, rel=1e-9)


def test_a_rounding_format_states_its_dtype():
    """RoundingFormat has no silent float32 default: the caller names the dtype of its checkpoints."""
    with pytest.raises(TypeError):
        RoundingFormat(lambda S: S)
    fmt = RoundingFormat(lambda S: S, dtype=torch.float64)
    S = torch.randn(1, 1, 2, 2, dtype=torch.float64) / 3
    assert fmt.zeros((1, 1, 2, 2), torch.device("cpu")).dtype == torch.float64 and torch.equal(fmt.store(S), S)
