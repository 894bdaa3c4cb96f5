import pytest
import torch

from pace_core.analysis.calibration import calibrate, calibration_samples, protocol_samples, reference_samples
from pace_core.analysis.sweep import record_gdn_inputs
from pace_core.analysis.text import CALIBRATION_TEXT, TEST_TEXT, read_text, tokenize
from pace_core.config import get_config
from pace_core.errors import PaceError
from pace_core.methods import Sampling
from pace_core.methods import stepquant as sq_method
from pace_core.methods.stepquant import algorithm as sq
from pace_core.methods.stepquant import token_sums
from pace_core.model.capture import run_with_states
from pace_core.model.loading import load_model
from pace_core.quant import fake_quantize

pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return load_model(tiny_checkpoints["qwen3_5_text"])


def test_samples_match_decode_path_and_decays_match_hidden_states(loaded):
    ids = torch.randint(3, 100, (1, 50))
    states, inputs = reference_samples(loaded, ids, 16)
    g = {layer: x["g"] for layer, x in inputs.items()}
    run = run_with_states(loaded, get_config("fp32"), ids, decode_from=16, capture_steps=[16, 32, 48])
    for layer in loaded.gdn_layers:
        assert states[layer].shape == (3, 4, 64, 32)
        for i, step in enumerate([16, 32, 48]):
            torch.testing.assert_close(states[layer][i], run.states[step][layer][0], rtol=1e-4, atol=1e-5)
    # independent g: GDN input = input_layernorm(hidden state entering the layer)
    with torch.no_grad():
        hs = loaded.model(ids, output_hidden_states=True).hidden_states
        for layer in loaded.gdn_layers:
            dec = loaded.model.model.layers[layer]
            a = dec.linear_attn.in_proj_a(dec.input_layernorm(hs[layer]))[0].double()
            want = -dec.linear_attn.A_log.double().exp() * torch.nn.functional.softplus(
                a + dec.linear_attn.dt_bias.double()
            )
            assert g[layer].shape == (48, 4)
            torch.testing.assert_close(g[layer].double(), want[:48], rtol=1e-4, atol=1e-5)
            b = dec.linear_attn.in_proj_b(dec.input_layernorm(hs[layer]))[0].double()
            torch.testing.assert_close(inputs[layer]["beta"].double(), torch.sigmoid(b)[:48], rtol=1e-4, atol=1e-5)
            q, k = inputs[layer]["q"], inputs[layer]["k"]  # prepared: unit keys, queries of norm K^-1/2
            assert q.shape == k.shape == (48, 2, 64)
            torch.testing.assert_close(k.norm(dim=-1), torch.ones(48, 2), rtol=1e-5, atol=0)
            torch.testing.assert_close(q.norm(dim=-1), torch.full((48, 2), 64 ** -0.5), rtol=1e-5, atol=0)


def test_calibrate_pace_4_8(loaded):
    cfg = get_config("pace-4-8")
    cal = calibrate(loaded, cfg, tokens=96, sample_every=32)
    assert cal.tokens == 96 and cal.samples == 3
    ids = tokenize(loaded.tokenizer, read_text(CALIBRATION_TEXT), 96)
    states, inputs = reference_samples(loaded, ids, 32)
    g = {layer: x["g"] for layer, x in inputs.items()}
    for i, layer in enumerate(loaded.gdn_layers):
        S = states[layer].double()
        e = (fake_quantize(states[layer], cfg.quant_spec()).double() - S).square().sum((-2, -1)).mean(0)
        torch.testing.assert_close(cal.e[i], e, rtol=1e-9, atol=0)
        torch.testing.assert_close(cal.a[i], g[layer].double().exp().mean(0), rtol=1e-9, atol=0)
        torch.testing.assert_close(cal.E[i], e / (1 - cal.a[i] ** (2 * cfg.decode_period)), rtol=1e-9, atol=0)
        high = cal.config.high_heads[i]
        assert len(high) == 1  # round(0.25 * 4)
        assert cal.E[i, high[0]] == cal.E[i].max()
    assert cal.config.replace(high_heads=None, high_share=0.25) == cfg
    tab = cal.table()
    assert len(tab) == 4 * len(loaded.gdn_layers) and tab.high.sum() == len(loaded.gdn_layers)


def test_calibrate_on_kept_samples(loaded):
    """Samples taken once serve every quantiser: the same calibration as reading the text again (the same
    code on the same inputs, so bit for bit)."""
    samples = calibration_samples(loaded, tokens=96, sample_every=32)
    assert samples.tokens == 96 and set(samples.states) == set(loaded.gdn_layers)
    for cfg in (get_config("pace-4-8").replace(bits=3), get_config("rtn-int4").replace(high_share=0.5,
                                                                                      group_axis="value")):
        kept, fresh = calibrate(loaded, cfg, samples=samples), calibrate(loaded, cfg, tokens=96, sample_every=32)
        assert torch.equal(kept.e, fresh.e) and torch.equal(kept.a, fresh.a)
        assert kept.config.high_heads == fresh.config.high_heads


def test_calibrate_refuses_test_split_and_bad_input(loaded, tmp_path):
    fake = tmp_path / "wikitext2-test.txt"
    fake.write_text("some text " * 50)
    for path in (fake, TEST_TEXT):
        with pytest.raises(PaceError, match="test split"):
            calibrate(loaded, get_config("pace-4-8"), path)
    empty = tmp_path / "e.txt"
    empty.write_text("")
    with pytest.raises(PaceError, match="empty"):
        calibrate(loaded, get_config("pace-4-8"), empty)
    with pytest.raises(PaceError, match="nothing to calibrate"):
        calibrate(loaded, get_config("fp32"))


def test_calibrate_qwen3_next_and_damp(tiny_checkpoints):
    m = load_model(tiny_checkpoints["qwen3_next"])
    cal = calibrate(m, get_config("damp-int4").replace(damp_outlier_rows=4), tokens=64, sample_every=32)
    assert ((cal.a > 0) & (cal.a <= 1)).all()
    rows = [layer["rows"] for layer in cal.config.calibrated.layers]
    assert [tuple(r.shape) for r in rows] == [(4, 4)] * len(m.gdn_layers) and rows[0].dtype == torch.int16


def test_calibrate_static_scales(loaded):
    """Static scales are calibrated per layer from the same samples (the method's hook, for these settings): each
    group's max |x| over the reference states (in the key-rotated basis with key_hadamard), rounded up to fp16;
    with 8-bit heads the heads are chosen as well. The result needs no further calibration."""
    from pace_core.checkpoint import hadamard

    samples = calibration_samples(loaded, tokens=96, sample_every=32)
    for cfg in (get_config("pace-4-static").replace(group_size=32),
                get_config("pace-4-8").replace(scales="static", key_hadamard=True)):
        assert cfg.needs_calibration
        cal = calibrate(loaded, cfg, samples=samples)
        assert not cal.config.needs_calibration and (cal.config.high_heads is not None) == (cfg.high_share > 0)
        for i, layer in enumerate(loaded.gdn_layers):
            S = samples.states[layer].double()
            if cfg.key_hadamard:
                S = (hadamard(S.shape[-2]) @ S).float().double()
            n, hv, k, v = S.shape
            grouped = S.reshape(n, hv, k // cfg.group_size, cfg.group_size, v)
            got = cal.config.calibrated.layers[i]
            if cfg.symmetric:
                want = {"amax": grouped.abs().amax(3).amax(0)}
            else:
                want = {"low": grouped.amin(3).amin(0).clamp(max=0), "high": grouped.amax(3).amax(0).clamp(min=0)}
            assert set(got) == {("rotated_" if cfg.key_hadamard else "") + name for name in want}
            for name, t in got.items():
                ref = want[name.removeprefix("rotated_")]
                assert (t.double().abs() >= ref.abs()).all() and (
                    t.double() - ref
                ).abs().max() <= 2.0**-10 * ref.abs().max()


SMALL = Sampling("a small protocol", segments=3, tokens=32, every=8, reservoir=5, seed=0, reduce=token_sums)
"""STEPQuant's protocol at a test's size: 12 states offered per layer to a reservoir of 5."""


def test_protocol_samples_are_the_authors_sampling(loaded):
    """protocol_samples against the repository's procedure written out here: windows at offsets drawn by a generator
    seeded 0, every 8th state offered in order to a reservoir (slot randint(k) of its own generator seeded 0 for the
    k-th state once full), ω and ḡ over every token of every window (issue 46)."""
    samples = protocol_samples(loaded, CALIBRATION_TEXT, SMALL)
    ids = tokenize(loaded.tokenizer, read_text(CALIBRATION_TEXT))
    rng = torch.Generator().manual_seed(0)
    starts = [int(torch.randint(ids.shape[1] - 32 + 1, (), generator=rng)) for _ in range(3)]
    offered = {layer: [] for layer in loaded.gdn_layers}
    windows = []
    for s in starts:
        window = ids[:, s:s + 32]
        run = run_with_states(loaded, get_config("fp32"), window, decode_from=8, capture_steps=[8, 16, 24, 32])
        for layer in loaded.gdn_layers:
            offered[layer] += [run.states[t][layer][0] for t in (8, 16, 24, 32)]
        windows.append(record_gdn_inputs(loaded, window))
    for i, layer in enumerate(loaded.gdn_layers):
        kept, count, gen = [], 0, torch.Generator().manual_seed(0)
        for S in offered[layer]:
            count += 1
            if len(kept) < 5:
                kept.append(S)
            else:
                j = torch.randint(count, (), generator=gen).item()
                if j < 5:
                    kept[j] = S
        torch.testing.assert_close(samples.states[layer], torch.stack(kept), rtol=1e-4, atol=1e-5)
        q, k, g, beta = (torch.cat([getattr(w, name)[i] for w in windows]) for name in ("q", "k", "g", "beta"))
        omega = sq.impact_omega(q, k, beta, g.exp())
        torch.testing.assert_close(samples.sums[layer]["omega"] / samples.tokens, omega, rtol=1e-4, atol=0)
        torch.testing.assert_close(samples.sums[layer]["g"] / samples.tokens, g.double().mean(0), rtol=1e-4, atol=0)
        torch.testing.assert_close(samples.inputs[layer]["g"].double(), g.double().reshape(3, 32, -1), rtol=1e-4,
                                   atol=1e-6)
    assert (samples.tokens, samples.sample_every, samples.sampling) == (96, 8, SMALL)
    assert samples.describe() == (f"96 tokens of {CALIBRATION_TEXT.name} (3 segments of 32 tokens at random offsets "
                                  "(seed 0), a state every 8 tokens into a reservoir of 5 per layer), 5 states")


def test_stepquant_calibrates_on_the_authors_samples_when_asked(loaded, monkeypatch, tmp_path):
    """stepquant_calibration 'authors' calibrates on the method's own samples, even when given the shared ones; the
    default calibrates on the shared samples it is given (issue 46: nothing told the user, there was no choice)."""
    authors = sq_method.AUTHORS
    assert (authors.segments, authors.tokens, authors.every, authors.reservoir, authors.seed) == (32, 2048, 8, 64, 0)
    monkeypatch.setattr(sq_method, "AUTHORS", SMALL)
    cfg = get_config("stepquant-4").replace(stepquant_calibration="authors")
    shared = calibration_samples(loaded, CALIBRATION_TEXT, tokens=64, sample_every=32)
    cal = calibrate(loaded, cfg, samples=shared)
    assert (cal.tokens, cal.samples) == (96, 5)
    own = protocol_samples(loaded, CALIBRATION_TEXT, SMALL)
    want = sq_method.calibrate(cfg, own, list(loaded.gdn_layers))
    for got, layer in zip(cal.config.calibrated.layers, want):
        assert torch.equal(got["widths"], layer["widths"])
        torch.testing.assert_close(got["impact"], layer["impact"], rtol=1e-5, atol=0)
    default = calibrate(loaded, get_config("stepquant-4"), samples=shared)
    assert (default.tokens, default.samples) == (64, 2)
    short = tmp_path / "short.txt"
    short.write_text("Too short for a window.")
    monkeypatch.setattr(sq_method, "AUTHORS", authors)
    with pytest.raises(PaceError, match="gives .* tokens; the authors' calibration samples read windows of 2,048; "
                                        "allowed: a longer text, or the shared calibration samples"):
        calibrate(loaded, cfg, short)
