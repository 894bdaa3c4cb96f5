"""pace_core.model.patch: PACE inside transformers' own GDN layers, for every hybrid model type
(tiny random checkpoints saved with save_pretrained and loaded with from_pretrained)."""

from __future__ import annotations

import sys
import threading

import pandas as pd
import pytest
import torch
from conftest import HYBRID_TYPES
from numerics import assert_same_greedy, fp32_bound, rel

from pace_core.accounting import state_bytes
from pace_core.config import get_config
from pace_core.errors import PaceError
from pace_core.methods import Calibrated
from pace_core.model.capture import run_with_states
from pace_core.model.loading import load_model
from pace_core.model.patch import (
    CORE_FUNCTIONS,
    apply_pace,
    current_config,
    gdn_modules,
    get_state_store,
    pace,
    remove_pace,
)
from pace_core.quant import PackedTensor

pytestmark = pytest.mark.numerics

NEW_TOKENS = 12
FP32_BUFFERED = get_config("fp32").replace(name="fp32-buffered", decode_period=8, prefill_period=5, buffer="fp32")
"""Quantisation off, buffering on: no rounding, fp32 decode buffer with a flush every 8 tokens,
5-token prefill segments."""


TOL = fp32_bound(4 * (64 + 25 * 64 + 4 * 32 + 64 + 96) + 64)
"""Two code paths of the same function on the tiny models (prompt 13 + 12 new tokens): per layer the
64-wide projections, the GDN state over 25 tokens of 64-wide keys, 4 value heads of 32, the MLP (64 +
96); 4 layers, then the 64-wide LM head (tests/numerics.py)."""


def _prompt(seed: int, batch: int = 2, length: int = 13) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 100, (batch, length), generator=g)


def _generate(model, ids, attention_mask=None):
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
            do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=0,
        )


def _gdn_cache_tensors(cache, layers):
    return [cache.layers[i].recurrent_states[0] for i in layers]


@pytest.fixture(scope="module")
def loaded_models(tiny_checkpoints):
    return {t: load_model(tiny_checkpoints[t]) for t in HYBRID_TYPES}


@pytest.mark.parametrize("model_type", HYBRID_TYPES)
def test_reference_and_buffered_fp32_match_transformers(loaded_models, model_type):
    loaded = loaded_models[model_type]
    model = loaded.model
    ids = _prompt(1)
    with torch.no_grad():
        ref_logits = model(ids).logits
    ref = _generate(model, ids)
    assert all(t.shape == (2, 4, 64, 32) for t in _gdn_cache_tensors(ref.past_key_values, loaded.gdn_layers))

    with pace(model, get_config("fp32")):  # PACE off: transformers' own path, bit for bit
        assert current_config(model) is None
        with torch.no_grad():
            assert torch.equal(model(ids).logits, ref_logits)
        off = _generate(model, ids)
        assert torch.equal(off.sequences, ref.sequences)
        assert get_state_store(off.past_key_values) is None

    with pace(model, FP32_BUFFERED):  # through the store, no rounding: transformers' function to float32 rounding
        with torch.no_grad():
            assert rel(model(ids).logits, ref_logits) <= TOL
        run = _generate(model, ids)
        parted = assert_same_greedy(run.sequences[:, ids.shape[1]:], ref.sequences[:, ids.shape[1]:], run.logits,
                                    ref.logits, TOL)
        store = get_state_store(run.past_key_values)
        for layer in loaded.gdn_layers:
            # 11 decode forwards after the prompt: one flush at 8, 3 records buffered
            assert len(store.buffer(layer)) == 3 and store.buffer(layer).precision == "fp32"
            if not parted:
                reference_state = ref.past_key_values.layers[layer].recurrent_states[0]
                assert rel(store.effective_state(layer), reference_state) <= TOL
        assert all(t.numel() == 0 for t in _gdn_cache_tensors(run.past_key_values, loaded.gdn_layers))
    assert current_config(model) is None


def test_bf16_reference_holds_the_bf16_rounding_of_the_state(loaded_models):
    loaded = loaded_models["qwen3_5_text"]
    ids = _prompt(7)
    with torch.no_grad():
        ref = loaded.model(ids, use_cache=True).past_key_values
        with pace(loaded.model, get_config("bf16")):
            cache = loaded.model(ids, use_cache=True).past_key_values
            assert _generate(loaded.model, ids).sequences.shape == (2, 13 + NEW_TOKENS)
    store = get_state_store(cache)
    for layer in loaded.gdn_layers:
        checkpoint = store.layer(layer).checkpoint
        assert checkpoint.dtype == torch.bfloat16 and store.layer_nbytes(layer)["payload"] == 2 * 4 * 64 * 32 * 2
        # one prefill segment (P = 256 > 13 tokens): the stored state is the bf16 cast of the fp32 state
        expected = ref.layers[layer].recurrent_states[0].to(torch.bfloat16).float()
        got = checkpoint.float()
        # at most one bf16 step apart (a cast may flip where the two fp32 computations differ by
        # ~1e-7 of the state's scale), and almost all entries identical
        step = torch.maximum(expected.abs(), got.abs()) * 2.0**-7 + 1e-6 * expected.abs().max()
        assert torch.all((got - expected).abs() <= step)
        assert (got == expected).float().mean() >= 0.99


@pytest.mark.parametrize("model_type", HYBRID_TYPES)
def test_pace4_generation_holds_the_state_packed(loaded_models, model_type):
    loaded = loaded_models[model_type]
    model = loaded.model
    cfg = get_config("pace-4")
    ids = _prompt(2)
    with pace(model, cfg):
        run = _generate(model, ids)
    assert run.sequences.shape == (2, 13 + NEW_TOKENS)
    cache = run.past_key_values
    store = get_state_store(cache)
    # the cache keeps no full-precision copy of the recurrent state
    assert all(t.numel() == 0 for t in _gdn_cache_tensors(cache, loaded.gdn_layers))
    fp32_bytes = 2 * 4 * 64 * 32 * 4  # one GDN layer, batch 2
    for layer in loaded.gdn_layers:
        checkpoint = store.layer(layer).checkpoint
        assert isinstance(checkpoint, PackedTensor) and checkpoint.codes.dtype == torch.uint8
        parts = store.layer_nbytes(layer)
        assert parts["payload"] == fp32_bytes // 8  # 4-bit codes, two per byte
        assert parts["metadata"] == fp32_bytes // 128  # one fp16 scale per 64 key entries
    expected = state_bytes(cfg, loaded.shape, 2)
    assert abs(store.nbytes() - expected) <= 0.01 * expected
    # 12 decode tokens: the decode buffer (dP = 8) was flushed once and holds 4 records
    assert all(len(store.buffer(layer)) == (NEW_TOKENS - 1) % 8 for layer in loaded.gdn_layers)


def test_pace4_changes_outputs_only_where_rounding_reaches(loaded_models):
    """With P = 4, prompt positions 0..3 see no rounding (identical logits); later positions read a
    rounded state and differ."""
    model = loaded_models["qwen3_5_text"].model
    ids = _prompt(3, batch=1, length=12)
    with torch.no_grad():
        ref = model(ids).logits
        with pace(model, get_config("pace-4").replace(prefill_period=4)):
            out = model(ids).logits
    assert rel(out[:, :4], ref[:, :4]) <= TOL  # the store's prefill: transformers' function
    assert rel(out[:, 4:], ref[:, 4:]) > 1e-3


@pytest.mark.parametrize("cfg", [FP32_BUFFERED, get_config("pace-4")], ids=lambda c: c.name)
def test_left_padded_batch_matches_single_runs(loaded_models, cfg):
    loaded = loaded_models["qwen3_5"]
    tok = loaded.tokenizer
    texts = ["Hi", "The quick brown fox"]
    batch = tok(texts, return_tensors="pt", padding=True)
    assert batch.attention_mask[0, 0] == 0  # padded on the left
    with pace(loaded.model, cfg):
        together = _generate(loaded.model, batch.input_ids, batch.attention_mask)
        width = batch.input_ids.shape[1]
        for row, text in enumerate(texts):
            single = tok([text], return_tensors="pt")
            alone = _generate(loaded.model, single.input_ids, single.attention_mask)
            n = single.input_ids.shape[1]
            # a batch of two (other GEMM shapes, padding) against a run alone: to float32 rounding
            assert_same_greedy(together.sequences[row:row + 1, width:], alone.sequences[:, n:],
                               [a[row:row + 1] for a in together.logits], alone.logits, TOL)


def test_remove_restores_the_original_layers(loaded_models):
    model = loaded_models["qwen3_next"].model
    modeling = sys.modules[type(gdn_modules(model)[0][1]).__module__]
    originals = {name: getattr(modeling, name) for name in CORE_FUNCTIONS}
    ids = _prompt(4)
    with torch.no_grad():
        ref = model(ids).logits
        apply_pace(model, get_config("rtn-int4"))
        apply_pace(model, get_config("rtn-int4"))  # idempotent
        assert not torch.equal(model(ids).logits, ref)
        wrapped = gdn_modules(model)[0][1].forward
        apply_pace(model, get_config("pace-4"))  # replaces the configuration, keeps one wrapper
        assert gdn_modules(model)[0][1].forward is wrapped and current_config(model).name == "pace-4"
        remove_pace(model)
        assert torch.equal(model(ids).logits, ref)
    assert all("forward" not in m.__dict__ for _, m in gdn_modules(model))
    assert {name: getattr(modeling, name) for name in CORE_FUNCTIONS} == originals
    remove_pace(model)  # no-op


def test_pace_context_restores_the_previous_config(loaded_models):
    model = loaded_models["qwen3_5_moe"].model
    apply_pace(model, get_config("rtn-int8"))
    try:
        with pace(model, get_config("pace-4")):
            assert current_config(model).name == "pace-4"
        assert current_config(model).name == "rtn-int8"
    finally:
        remove_pace(model)
    assert current_config(model) is None


def test_cache_of_another_config_and_bad_input_are_refused(loaded_models):
    model = loaded_models["qwen3_5_moe_text"].model
    ids = _prompt(5)
    with pace(model, get_config("pace-4")), torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    apply_pace(model, get_config("rtn-int4"))
    try:
        with pytest.raises(PaceError, match="another configuration"), torch.no_grad():
            model(ids[:, :1], past_key_values=cache, use_cache=True)
    finally:
        remove_pace(model)
    with pytest.raises(PaceError, match="crop"):
        cache.crop(-1)
    with torch.no_grad():  # a cache filled without PACE holds a full-precision state PACE cannot take over
        plain = model(ids, use_cache=True).past_key_values
        with pace(model, get_config("pace-4")), pytest.raises(PaceError, match="without PACE"):
            model(ids[:, :1], past_key_values=plain, use_cache=True)
    with pytest.raises(PaceError, match="cfg"):
        apply_pace(model, "pace-4")
    with pytest.raises(PaceError, match="not calibrated"):
        apply_pace(model, get_config("damp-int4"))
    with pytest.raises(PaceError, match="group_size"):  # key-axis groups of 128 do not divide d_k = 64
        apply_pace(model, get_config("pace-4").replace(group_size=128))
    assert current_config(model) is None


def test_beam_search_reorders_the_store(loaded_models):
    """Beam search under PACE moves each beam's state with it: every returned beam's score equals the
    log-probability of its tokens teacher-forced through the same configuration from the prompt alone (a
    beam continuing from another beam's state would not). The two runs differ only in batch shape, so
    they agree to float32 rounding."""
    loaded = loaded_models["qwen3_5_text"]
    model, eos = loaded.model, loaded.model.config.eos_token_id
    ids = _prompt(6, batch=1)
    n = ids.shape[1]
    with pace(model, FP32_BUFFERED), torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, min_new_tokens=6, num_beams=3, num_return_sequences=3,
                             do_sample=False, length_penalty=0.0, pad_token_id=0, return_dict_in_generate=True,
                             output_scores=True)
    assert len({tuple(s.tolist()) for s in out.sequences}) == 3
    for seq, score in zip(out.sequences, out.sequences_scores):
        logits = run_with_states(loaded, FP32_BUFFERED, seq[None], decode_from=n).logits[0, n - 1:-1].double()
        logits[:, eos] = -torch.inf  # min_new_tokens masks the end token at every step
        logp = torch.log_softmax(logits, -1).gather(1, seq[n:, None])
        assert abs(float(logp.sum()) - float(score)) <= TOL * float(logp.abs().sum())


def test_non_hybrid_model_is_refused(tiny_checkpoints):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["qwen3"])
    with pytest.raises(PaceError, match="no Gated DeltaNet layers"):
        apply_pace(model, get_config("pace-4"))


@pytest.mark.parametrize(
    "cfg",
    [get_config("pace-4-8").replace(high_heads=((0,), (3,), (1,))), get_config("rtn-int4"), get_config("damp-int4")],
    ids=lambda c: c.name,
)
def test_forward_without_cache_equals_forward_with_cache(loaded_models, cfg):
    """Without a cache each GDN layer gets its own store (with its share of the per-layer
    settings); the outputs equal those of a cached forward. Also runs generation for each method."""
    model = loaded_models["qwen3_5_text"].model
    ids = _prompt(8, length=20)
    rows = [torch.randperm(64, generator=torch.Generator().manual_seed(i))[:16].expand(4, 16) for i in range(3)]
    if cfg.method == "damp":
        cfg = cfg.replace(calibrated=Calibrated([{"rows": r.to(torch.int16)} for r in rows]))
    with pace(model, cfg.replace(prefill_period=8)), torch.no_grad():
        cached = model(ids, use_cache=True)
        uncached = model(ids, use_cache=False)
        assert uncached.past_key_values is None
        assert torch.equal(cached.logits, uncached.logits)
        run = _generate(model, ids)
    store = get_state_store(run.past_key_values)
    assert store.bits_per_head(3) == ((4, 8, 4, 4) if cfg.method == "pace" else (4,) * 4)


def test_each_layer_state_is_allocated_on_its_module_device(loaded_models, monkeypatch):
    """Under device_map every GDN layer has its own GPU: a cache's store and a stack allocate each layer's
    state on its module's device, not all on one (which would hold every layer's zero state there until the
    first tokens). Here every module is on the CPU and the stack is asked for another device: the layers
    follow their modules; a module with offloaded (meta) parameters falls back to the device asked for."""
    from pace_core.model import patch

    loaded = loaded_models[HYBRID_TYPES[0]]
    model, modules = loaded.model, gdn_modules(loaded.model)
    assert patch.layer_devices(modules, torch.device("meta")) == {i: torch.device("cpu") for i, _ in modules}
    offloaded = torch.nn.Linear(2, 2, device="meta")
    assert patch.layer_devices([(0, offloaded)], torch.device("cpu")) == {0: torch.device("cpu")}
    with patch.stacked(model, [get_config("pace-4"), get_config("fp32")], 1, device=torch.device("meta")) as (_, stack):
        for store in stack.stores:
            assert {store.layer(i).device for i in store.layers} == {torch.device("cpu")}
    with pace(model, get_config("pace-4")), torch.no_grad():
        out = model(input_ids=_prompt(0, batch=1), use_cache=True)
    store = get_state_store(out.past_key_values)
    assert {store.layer(i).device for i in store.layers} == {torch.device("cpu")}


class _Interrupt(BaseException):
    """What streamlit raises inside a script it stops or reruns (its StopException and RerunException are
    not Exceptions either): here from a progress callback, i.e. inside a GDN core call or between steps."""


def _model_is_unpatched(model) -> bool:
    """No configuration in effect, no wrapped GDN forward, transformers' own core functions."""
    modeling = sys.modules[type(gdn_modules(model)[0][1]).__module__]
    originals = {name: getattr(modeling, name).__module__ for name in CORE_FUNCTIONS}
    return (current_config(model) is None and all("forward" not in m.__dict__ for _, m in gdn_modules(model))
            and set(originals.values()) == {modeling.__name__})


def _drift(loaded, progress):
    from pace_core.analysis.drift import drift

    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(11))
    return drift(loaded, {"pace-4": get_config("pace-4"), "rtn-int4": get_config("rtn-int4")}, ids, 16, every=4,
                 progress=progress).table


def _generation(loaded, progress):
    from pace_core.analysis.generation import generate_side_by_side

    return generate_side_by_side(loaded, {"pace-4": get_config("pace-4"), "rtn-int4": get_config("rtn-int4")},
                                 "The state of", max_new_tokens=8, modes=("greedy", "sampled"), progress=progress)


def _quality(loaded, progress):
    from pace_core.analysis.quality import evaluate_quality

    ids = torch.randint(3, 100, (1, 48), generator=torch.Generator().manual_seed(12))
    return evaluate_quality(loaded, {"pace-4": get_config("pace-4")}, ids, window=32, stride=16, progress=progress)


@pytest.mark.parametrize("run", [_drift, _generation, _quality], ids=lambda f: f.__name__.strip("_"))
def test_an_interrupted_run_leaves_the_model_as_it_was(loaded_models, run):
    """A run stopped by a BaseException from its progress callback (at the first unit, inside the prompt's
    forward, and at the seventh, later in the run) leaves the shared model unpatched, and the next run on the
    same LoadedModel gives the fresh run's result: the same code on the same inputs, bit for bit."""
    loaded = loaded_models["qwen3_5_text"]
    fresh = run(loaded, None)
    for after in (1, 7):
        done = []

        def progress(n: int, done=done, after=after) -> None:
            done.append(n)
            if len(done) == after:
                raise _Interrupt

        with pytest.raises(_Interrupt):
            run(loaded, progress)
        assert _model_is_unpatched(loaded.model)
        pd.testing.assert_frame_equal(run(loaded, None), fresh)


def test_a_run_superseded_in_another_thread_keeps_its_configuration(loaded_models):
    """Streamlit's fast reruns start the new run in a new thread while the run it supersedes goes on until its
    next progress update, where it is stopped. Run A holds the model in its scope, run B starts, A is stopped
    and unwinds while B is in the middle of its run: B sees only its own configuration (before the scopes, A's
    exit unpatched the model under B, and B failed with "Expected size ... [8, 128] but got: [8, 0]") and gives
    the result of B alone, bit for bit; afterwards the model is unpatched."""
    from pace_core.analysis.drift import drift

    loaded = loaded_models["qwen3_5_text"]
    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(13))
    configs_a, configs_b = {"a": get_config("pace-4")}, {"b": get_config("pace-4").replace(decode_period=16)}
    alone = drift(loaded, configs_b, ids, 16, every=4).table
    b_running, a_gone, outcome = threading.Event(), threading.Event(), {}

    def progress_a(n: int) -> None:
        assert b_running.wait(60)
        raise _Interrupt

    def progress_b(n: int) -> None:
        b_running.set()
        assert a_gone.wait(60)

    def run_a() -> None:
        try:
            drift(loaded, configs_a, ids, 16, every=4, progress=progress_a)
        except _Interrupt:
            outcome["a"] = "stopped"
        finally:
            a_gone.set()

    def run_b() -> None:
        try:
            outcome["b"] = drift(loaded, configs_b, ids, 16, every=4, progress=progress_b).table
        except Exception as err:  # reported by the assertion below
            outcome["b"] = err

    threads = [threading.Thread(target=run_a), threading.Thread(target=run_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert outcome["a"] == "stopped"
    assert isinstance(outcome["b"], pd.DataFrame), outcome["b"]
    pd.testing.assert_frame_equal(outcome["b"], alone)
    assert _model_is_unpatched(loaded.model)
