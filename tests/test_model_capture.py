"""pace_core.model.capture: teacher-forced runs that capture every GDN layer's state, checked
against transformers' own fp32 computation and against the quantiser applied to it."""

from __future__ import annotations

import pytest
import torch
from numerics import fp32_bound, rel

from pace_core.config import get_config
from pace_core.errors import PaceError
from pace_core.model.capture import run_with_states
from pace_core.model.loading import load_model
from pace_core.model.patch import apply_pace, current_config, remove_pace
from pace_core.quant import QuantSpec, fake_quantize

pytestmark = pytest.mark.numerics

PACE4 = get_config("pace-4")
PACE4_SPEC = QuantSpec(bits=4, symmetric=True, axis="key", group_size=64)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return load_model(tiny_checkpoints["qwen3_5"])


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 100, (2, 22), generator=torch.Generator().manual_seed(11))


TOL = fp32_bound(4 * (64 + 22 * 64 + 4 * 32 + 64 + 96) + 64)
"""Two code paths of one function on the tiny model (22 tokens): per layer the 64-wide projections, the GDN
state over 22 tokens of 64-wide keys, 4 value heads of 32, the MLP (64 + 96); 4 layers, then the 64-wide
LM head (tests/numerics.py)."""


def test_reference_run_is_transformers_own_computation(loaded, ids):
    """The fp32 reference run (through the store: the prompt chunked, the rest teacher-forced in one more
    forward) computes transformers' own function: logits and states to float32 rounding."""
    run = run_with_states(loaded, get_config("fp32"), ids, decode_from=10, capture_steps=[10, 22])
    model = loaded.model
    with torch.no_grad():
        full = model(ids, use_cache=True)
        prompt = model(ids[:, :10], use_cache=True)
    assert run.logits.shape == (2, 22, 128) and run.logits.dtype == torch.float32
    assert rel(run.logits, full.logits) <= TOL
    assert sorted(run.states) == [10, 22] and run.decode_from == 10
    for layer in loaded.gdn_layers:
        assert run.states[10][layer].shape == (2, 4, 64, 32)
        assert rel(run.states[10][layer], prompt.past_key_values.layers[layer].recurrent_states[0]) <= TOL
        assert rel(run.states[22][layer], full.past_key_values.layers[layer].recurrent_states[0]) <= TOL
        assert run.state_nbytes[layer] == {"payload": 2 * 4 * 64 * 32 * 4, "metadata": 0, "buffer": 0}


def test_prefill_state_is_the_quantised_reference_state(loaded, ids):
    """P = 256 >= the 16-token prompt: one segment, so every layer's inputs equal the reference's
    and its stored state is Q(S_ref) (up to codes that flip where the two fp32 computations differ
    by ~1e-7 right at a rounding boundary)."""
    ref = run_with_states(loaded, get_config("fp32"), ids, decode_from=16, capture_steps=[16])
    run = run_with_states(loaded, PACE4, ids, decode_from=16, capture_steps=[16])
    for layer in loaded.gdn_layers:
        expected = fake_quantize(ref.states[16][layer], PACE4_SPEC)
        got = run.states[16][layer]
        step = ref.states[16][layer].abs().amax() / 7
        assert torch.all((got - expected).abs() <= step * 1.001)
        assert (got == expected).float().mean() >= 0.99  # a flipped fp16 scale changes one group
        assert _relative(got, expected) < 0.1 * _relative(expected, ref.states[16][layer])
        assert run.state_nbytes[layer]["payload"] == 2 * 4 * 64 * 32 // 2


def test_decode_error_of_the_first_layer_never_grows_between_flushes(loaded, ids):
    """Layer 0 sees the same tokens in both runs, so its state error evolves as
    E_t = α_t (I - β_t k_t k_tᵀ) E_{t-1} and cannot grow while the fp32 buffer holds the tokens;
    the flush after dP = 8 tokens puts the state back on the 4-bit grid."""
    cfg = PACE4.replace(buffer="fp32")
    steps = list(range(10, 19))
    ref = run_with_states(loaded, get_config("fp32"), ids, decode_from=10, capture_steps=steps)
    run = run_with_states(loaded, cfg, ids, decode_from=10, capture_steps=steps)
    layer = loaded.gdn_layers[0]
    errors = [(run.states[s][layer] - ref.states[s][layer]).norm().item() for s in steps]
    floor = 1e-5 * min(ref.states[s][layer].norm().item() for s in steps)  # fp32 noise of two computations
    assert errors[0] > 1e3 * floor
    assert all(b <= a * (1 + 1e-5) + floor for a, b in zip(errors[:8], errors[1:8]))
    on_grid = [torch.equal(fake_quantize(run.states[s][layer], PACE4_SPEC), run.states[s][layer]) for s in steps]
    assert on_grid == [True] + [False] * 7 + [True]  # after the prefill and after the flush at 8
    assert run.state_nbytes[layer]["buffer"] > 0


def test_run_restores_the_model_configuration(loaded, ids):
    apply_pace(loaded.model, get_config("rtn-int8"))
    try:
        run_with_states(loaded, PACE4, ids[:, :6], decode_from=4, capture_steps=[])
        assert current_config(loaded.model).name == "rtn-int8"
    finally:
        remove_pace(loaded.model)
    run = run_with_states(loaded, PACE4, ids[:, :6])
    assert run.states == {} and run.decode_from == 6 and run.logits.shape == (2, 6, 128)
    assert current_config(loaded.model) is None


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"decode_from": 0}, "decode_from"),
        ({"decode_from": 23}, "decode_from"),
        ({"decode_from": 10, "capture_steps": [9]}, "capture_steps"),
        ({"capture_steps": [23]}, "capture_steps"),
    ],
)
def test_bad_steps_name_the_field(loaded, ids, kwargs, field):
    with pytest.raises(PaceError, match=field):
        run_with_states(loaded, PACE4, ids, **kwargs)


def test_bad_input_ids(loaded, ids):
    with pytest.raises(PaceError, match="input_ids"):
        run_with_states(loaded, PACE4, ids.float())
    with pytest.raises(PaceError, match="input_ids"):
        run_with_states(loaded, PACE4, ids[0])


def test_decode_through_the_kernels_in_the_model(loaded, ids, monkeypatch):
    """The model's GDN decode routed to the Triton kernels (PACE_KERNELS=triton, interpreted here)
    gives the reference path's logits; PACE_KERNELS=reference never routes there."""
    from kernels_support import kernel_modules

    steps = kernel_modules()["backend"].TritonSteps
    calls = []  # tokens per window call
    kernel_window = steps.window
    monkeypatch.setattr(steps, "window", lambda self, st, q, *a, **kw: calls.append(q.shape[1])
                        or kernel_window(self, st, q, *a, **kw))
    cfg = get_config("pace-4").replace(decode_period=4)
    logits = {}
    for backend in ("triton", "reference"):
        monkeypatch.setenv("PACE_KERNELS", backend)
        calls.clear()
        logits[backend] = run_with_states(loaded, cfg, ids, decode_from=14).logits
        # every decoded token of every GDN layer through the kernels' windows, none on the reference path
        assert sum(calls) == (8 * len(loaded.gdn_layers) if backend == "triton" else 0)
    assert _relative(logits["triton"], logits["reference"]) < 1e-3
    assert _relative(logits["triton"][:, 14:], logits["reference"][:, 14:]) < 1e-3


def test_reference_captured_inside_its_prompt(loaded, ids):
    """The fp32 reference can be captured anywhere in its prompt: the states of one prefill at several counts
    are those of prefills of each prefix (the same function cut elsewhere: float32 rounding of a chunked
    recurrence, ~T·K operations per state entry)."""
    fp32 = get_config("fp32")
    run = run_with_states(loaded, fp32, ids, capture_steps=[5, 12, ids.shape[1]])
    for step in (5, 12):
        prefix = run_with_states(loaded, fp32, ids[:, :step], capture_steps=[step]).states[step]
        for layer, S in prefix.items():
            assert rel(run.states[step][layer], S) <= fp32_bound(ids.shape[1] * 64 * 8)
