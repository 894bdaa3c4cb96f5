"""pace_core.methods.stepquant: STEPQuant as a method of the studio, on a tiny checkpoint: its calibration wired to
the model's own inputs, its allocation within the nominal budget, its bytes exact, and a calibrated configuration
that runs, exports and applies like any other. (Its arithmetic against a float64 reference: tests/test_stepquant.py.)"""

from __future__ import annotations

import json
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from pace_core.accounting import resident_bits, state_bytes
from pace_core.analysis.calibration import calibrate, calibration_samples
from pace_core.analysis.drift import drift
from pace_core.analysis.text import tokenize
from pace_core.config import SETTING_OF, get_config
from pace_core.errors import PaceError
from pace_core.export import (
    config_from_dict,
    config_from_json,
    config_to_dict,
    config_to_json,
    export_document,
    export_json,
    read_config,
    used_fields,
)
from pace_core.memory import held_bytes
from pace_core.methods import stepquant as sq_method
from pace_core.methods.stepquant import algorithm as sq
from pace_core.model.deploy import apply
from pace_core.model.loading import load_model
from pace_core.model.patch import get_state_store, remove_pace

TEXT = "The state of a gated delta net layer keeps what it has read. " * 20


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return load_model(tiny_checkpoints["qwen3_5_text"])


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("stepquant") / "calibration.txt"
    path.write_text(TEXT)
    return path


@pytest.fixture(scope="module")
def samples(loaded, text):
    return calibration_samples(loaded, text, tokens=96, sample_every=16)


@pytest.mark.parametrize("name, share", [("stepquant-4", 1 / 72), ("stepquant-6", 1 / 18)])
def test_calibration_allocates_every_head_within_the_nominal_budget(loaded, samples, name, share):
    """Widths from the method's candidates (or pivots), the P = share · N (halves up) costliest heads as pivots, the
    nominal budget kept (a pivot charged 8 bits), and the allocation the one of the model's own inputs: the
    impact of each layer's recorded q, k, beta and exp(g), its lifetime from g's mean, its cost from its states."""
    cfg = get_config(name).replace(stepquant_pivot_share=share)
    cal = calibrate(loaded, cfg, samples=samples).config
    widths = torch.stack([layer["widths"] for layer in cal.calibrated.layers]).long()
    n_heads = widths.numel()
    pivots = sq.pivot_count(share, n_heads)
    assert set(widths.flatten().tolist()) <= {*sq.CANDIDATES[cfg.bits], sq.PIVOT}
    assert int((widths == sq.PIVOT).sum()) == pivots
    charged = sum(sq.PIVOT_CHARGE if b == sq.PIVOT else b for b in widths.flatten().tolist())
    assert charged <= n_heads * cfg.bits
    costs, impact = [], []
    for layer in loaded.gdn_layers:
        x = samples.inputs[layer]
        w = sq.impact_weights(sq.impact_omega(x["q"], x["k"], x["beta"], x["g"].exp()))
        impact.append(w.float())
        costs.append(sq.cost_table(samples.states[layer], w, sq.lifetime_weights(x["g"].double().mean(0)),
                                   sq.CANDIDATES[cfg.bits]))
    assert torch.equal(widths, sq.allocate(torch.stack(costs), cfg.bits, pivots, sq.CANDIDATES[cfg.bits]).long())
    for layer, w in zip(cal.calibrated.layers, impact):
        assert torch.equal(layer["impact"], w)


@pytest.mark.parametrize("layers, pivots", [(9, 1), (18, 1), (27, 2)])
def test_the_pivot_count_rounds_halves_up_as_documented(layers, pivots):
    """The method's calibration keeps share · N pivots rounded halves up, as its setting's help and the docstring
    say (issue 46: 1/72 of 36 heads gave 0, Python's round to even): 36 heads -> 1, 72 -> 1, 108 (1.5) -> 2."""
    gen = torch.Generator().manual_seed(layers)
    T, H, HV, K = 16, 2, 4, 32
    inputs = {i: {"q": torch.randn(T, H, K, generator=gen), "k": torch.randn(T, H, K, generator=gen),
                  "g": -torch.rand(T, HV, generator=gen), "beta": torch.rand(T, HV, generator=gen)}
              for i in range(layers)}
    states = {i: torch.randn(2, HV, K, K, generator=gen) for i in range(layers)}
    cfg = get_config("stepquant-4")
    widths = sq_method.calibrate(cfg, SimpleNamespace(inputs=inputs, states=states, sums=None), list(range(layers)))
    assert sum(int((layer["widths"] == sq.PIVOT).sum()) for layer in widths) == pivots
    assert [sq.pivot_count(1 / 72, n) for n in (35, 36, 107, 108)] == [0, 1, 1, 2]


def test_the_calibration_samples_are_a_visible_named_setting():
    """Which samples STEPQuant calibrates on is a setting (issue 46: it calibrated on PACE's shared samples where its
    authors sample 32 × 2,048 tokens, and nothing said so): 'shared' by default, 'authors' for their protocol, in the
    record and the export, with a sidebar control and URL key whose help explains the default; records made before
    it read as what they were made with (the shared samples)."""
    setting = SETTING_OF["stepquant_calibration"]
    assert (setting.default, setting.before, setting.url, setting.options) == ("shared", "shared", "sqc",
                                                                               ("shared", "authors"))
    assert all(words in setting.help for words in ("'shared' (default)", "2,048 tokens", "a state every 64",
                                                    "32 segments", "every 8 tokens", "64-state reservoir",
                                                    "WikiText-2 train", "validation split"))
    cfg = get_config("stepquant-4")
    authors = cfg.replace(stepquant_calibration="authors")
    assert cfg.stepquant_calibration == "shared" and "stepquant_calibration" in used_fields(cfg)
    assert sq_method.METHOD.sampling(authors) is sq_method.AUTHORS and sq_method.METHOD.sampling(cfg) is None
    assert config_from_dict(config_to_dict(authors)) == authors
    assert export_document(authors)["pace"]["stepquant_calibration"] == "authors"
    older = config_to_dict(cfg)
    older["schema_version"] = 6
    del older["pace"]["stepquant_calibration"]
    assert config_from_dict(older) == cfg
    with pytest.raises(PaceError, match="stepquant_calibration='train' is not allowed; allowed: 'shared'"):
        cfg.replace(stepquant_calibration="train")


def test_bytes_and_bits_are_those_of_the_calibrated_widths(loaded, samples):
    cfg = calibrate(loaded, get_config("stepquant-4"), samples=samples).config
    shape = loaded.shape
    widths = [int(b) for layer in cfg.calibrated.layers for b in layer["widths"].tolist()]
    exact = sq.resident_bits(widths, shape.d_k, shape.d_v)
    bits = resident_bits(cfg, shape)
    assert Fraction(bits.payload_bits).limit_denominator(1 << 20) == exact.resident_bits
    per_layer = [sq.stepquant_nbytes((3, shape.num_v_heads, shape.d_k, shape.d_v), layer["widths"].tolist())
                 + 2 * shape.num_v_heads + 4 * shape.num_v_heads * shape.d_k for layer in cfg.calibrated.layers]
    assert state_bytes(cfg, shape, 3) == sum(per_layer)
    # before a calibration: every head at the nominal width
    assert resident_bits(get_config("stepquant-4"), shape).payload_bits == float(
        sq.resident_bits([4] * shape.num_gdn_layers * shape.num_v_heads, shape.d_k, shape.d_v).resident_bits)


def test_a_calibrated_configuration_runs_exports_and_applies(loaded, samples, tmp_path):
    cfg = calibrate(loaded, get_config("stepquant-4"), samples=samples).config
    combined = calibrate(loaded, get_config("pace-stepquant-4"), samples=samples).config
    ids = tokenize(loaded.tokenizer, TEXT, 48)
    res = drift(loaded, [cfg, combined], ids, decode_from=24, every=4).summary.set_index("config")
    for name in (cfg.name, combined.name):  # 4-bit rounding of a state: a few to some tens of percent
        assert 0.001 < res.loc[name, "mean_rel_error"] < 0.5
    # the calibration travels with the configuration: the record and the export carry it
    assert config_from_json(config_to_json(cfg)) == cfg
    path = tmp_path / "stepquant-4.json"
    path.write_text(export_json(cfg, shape=loaded.shape, source=loaded.source, weights_fingerprint=loaded.fingerprint))
    doc = read_config(str(path))
    assert doc.config == cfg and json.loads(path.read_text())["pace"]["calibrated"] is not None
    apply(loaded.model, str(path))
    try:
        with torch.no_grad():
            out = loaded.model.generate(ids[:, :16], max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
        store = get_state_store(out.past_key_values)
        assert held_bytes(store) == state_bytes(cfg, loaded.shape, 1)
    finally:
        remove_pace(loaded.model)


def test_settings_are_checked():
    with pytest.raises(PaceError, match="bits=5 is not allowed for method 'stepquant'"):
        get_config("stepquant-4").replace(bits=5)
    with pytest.raises(PaceError, match="stepquant_pivot_share=0.5 is not allowed"):
        get_config("stepquant-4").replace(stepquant_pivot_share=0.5)
    with pytest.raises(PaceError, match="is a setting of method 'stepquant'"):
        get_config("pace-4").replace(stepquant_pivot_share=1 / 36)
    with pytest.raises(PaceError, match="not calibrated on the model"):
        from pace_core.methods import state_format

        state_format(get_config("stepquant-4"), (4,) * 4)
    assert get_config("stepquant-4").needs_calibration and get_config("stepquant-4").prefill_period == 1 << 20
