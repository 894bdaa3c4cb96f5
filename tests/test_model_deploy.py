"""pace_core.apply: one call applies an exported configuration to a transformers model, or refuses."""

import dataclasses
import json

import pytest
import torch

import pace_core
from pace_core.accounting import state_bytes
from pace_core.config import get_config
from pace_core.errors import PaceError
from pace_core.export import export_json
from pace_core.memory import held_bytes
from pace_core.model.loading import load_model
from pace_core.model.patch import current_config, get_state_store, pace, remove_pace


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return load_model(tiny_checkpoints["qwen3_5_text"])


def _export(loaded, cfg, tmp_path, *, fingerprint=None, **shape_changes):
    """The export of ``cfg`` for the loaded model, or for a model of another shape (``shape_changes``) or other
    weights (``fingerprint``): a consistent file made for another model."""
    shape = dataclasses.replace(loaded.shape, **shape_changes)
    path = tmp_path / "cfg.json"
    path.write_text(export_json(cfg, shape=shape, source=loaded.source,
                                weights_fingerprint=fingerprint or loaded.fingerprint))
    return path


def _greedy(model, ids):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)


def test_apply_runs_the_exported_configuration(loaded, tmp_path):
    cfg = get_config("pace-4").replace(prefill_period=4)
    path = _export(loaded, cfg, tmp_path)
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    with pace(loaded.model, cfg):
        expected = _greedy(loaded.model, ids)
    try:
        assert pace_core.apply(loaded.model, path) == cfg
        assert current_config(loaded.model) == cfg
        assert torch.equal(_greedy(loaded.model, ids), expected)  # the same code on the same inputs
        assert pace_core.apply(loaded.model, "rtn-int4").name == "rtn-int4"  # a name works too
    finally:
        remove_pace(loaded.model)


@pytest.mark.parametrize("changes, message", [({"num_v_heads": 8}, "num_v_heads 8 in the file"),
                                              ({"num_layers": 12}, "num_layers 12 in the file, 4 in the model"),
                                              ({"gdn_layers": (0, 1, 2)},
                                               r"gdn_layers \[0, 1, 2\] in the file, \[0, 1, 3\] in the model"),
                                              ({"fingerprint": "0" * 16}, "other weights")])
def test_a_file_for_another_model_is_refused(loaded, tmp_path, changes, message):
    with pytest.raises(PaceError, match=message):
        pace_core.apply(loaded.model, _export(loaded, get_config("pace-4"), tmp_path, **changes))
    assert current_config(loaded.model) is None


@pytest.mark.parametrize("section, key, value, message", [("pace", "bits", 99, "pace.bits is not allowed"),
                                                          ("state_layout", "groups_along", "value", "contradicts")])
def test_a_file_whose_sections_disagree_is_refused(loaded, tmp_path, section, key, value, message):
    path = _export(loaded, get_config("pace-4"), tmp_path)
    doc = json.loads(path.read_text())
    doc[section][key] = value
    path.write_text(json.dumps(doc))
    with pytest.raises(PaceError, match=message):
        pace_core.apply(loaded.model, path)
    assert current_config(loaded.model) is None


def test_apply_to_what_is_not_a_transformers_model_is_refused():
    """Before: AttributeError ('object' object has no attribute 'config')."""
    for model in (object(), None, torch.nn.Linear(2, 2)):
        with pytest.raises(PaceError, match="is not allowed; allowed: a transformers model"):
            pace_core.apply(model, "pace-4")


def test_what_needs_calibration_or_cannot_be_read_is_refused(loaded, tmp_path):
    with pytest.raises(PaceError, match="does not say which"):
        pace_core.apply(loaded.model, "pace-4-8")
    with pytest.raises(PaceError, match="outlier key rows"):
        pace_core.apply(loaded.model, "damp-int4")
    with pytest.raises(PaceError, match="cannot be read"):
        pace_core.apply(loaded.model, tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PaceError, match="not valid JSON"):
        pace_core.apply(loaded.model, tmp_path / "bad.json")


@pytest.mark.parametrize("name,bits", [*((f"rtn-int{b}", b) for b in range(2, 9)), ("pace-3", 3), ("pace-4-8", 3),
                                       ("pace-4-8", 4), ("pace-4-8", 6)])
def test_apply_holds_the_accounted_bytes_at_every_width(loaded, tmp_path, name, bits):
    """What a model applied with ``pace_core.apply`` keeps after generating is the accounting's state bytes, for every
    code width stored densely (issue 48): the exported file (8-bit heads chosen) applied, two sequences generated."""
    cfg = get_config(name).replace(prefill_period=4, bits=bits)
    if cfg.high_share > 0:
        cfg = cfg.replace(high_heads=tuple((1,) for _ in loaded.shape.gdn_layers))
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    try:
        pace_core.apply(loaded.model, _export(loaded, cfg, tmp_path))
        with torch.no_grad():
            out = loaded.model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0,
                                        return_dict_in_generate=True)
        store = get_state_store(out.past_key_values)
        assert held_bytes(store) == state_bytes(cfg, loaded.shape, 2) == store.nbytes()
    finally:
        remove_pace(loaded.model)
