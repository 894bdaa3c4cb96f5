"""pace_core.export: the deployable schema 4 document (model, layout, used settings, resident bits)."""

import json

import pytest

from pace_core.accounting import resident_bits
from pace_core.config import NAMED_CONFIGS, PaceConfig, config_to_json, document_from_json, get_config
from pace_core.errors import PaceError
from pace_core.export import (
    check_model,
    export_document,
    export_filename,
    export_json,
    used_fields,
    used_settings,
)
from pace_core.shapes import get_shape

SHAPE = get_shape("qwen3.5-27b")  # γ = 3: GDN ordinals and decoder layers differ from layer 3 on


@pytest.mark.parametrize("name", list(NAMED_CONFIGS))
def test_named_configs_round_trip_to_the_settings_they_use(name):
    cfg = NAMED_CONFIGS[name]
    doc = document_from_json(export_json(cfg, shape=SHAPE, source="Qwen/Qwen3.5-27B", weights_fingerprint="f00"))
    assert doc.config == used_settings(cfg)
    assert doc.model == "Qwen/Qwen3.5-27B" and doc.model_info["weights_fingerprint"] == "f00"
    assert doc.model_info["gdn_layers"] == list(SHAPE.gdn_layers)


def test_only_the_fields_the_method_reads():
    pace = export_document(get_config("pace-4"), shape=SHAPE)["pace"]
    assert "damp_outlier_rows" not in pace and "high_heads" not in pace and pace["buffer_precision"] == "int8"
    damp = export_document(get_config("damp-int4"), shape=SHAPE)["pace"]
    assert damp["damp_outlier_rows"] == 16 and "buffer_precision" not in damp  # dP = 1: no buffer
    mixed = used_fields(get_config("pace-4-8"))
    assert "buffer_key_group" in mixed and "buffer_value_group" not in mixed  # mixed: bf16 values
    # what is left out does not change behaviour: its defaults are what the method ignores
    custom = get_config("pace-4").replace(damp_outlier_rows=3, damp_hadamard=False)
    assert used_settings(custom) == get_config("pace-4")


def test_high_heads_keyed_by_decoder_layer_with_the_gdn_ordinal():
    heads = tuple((i % 45, i % 45 + 1, 47) for i in range(SHAPE.num_gdn_layers))
    cfg = PaceConfig(name="mine", high_share=3 / 48, high_heads=heads, decode_period=4)
    doc = export_document(cfg, shape=SHAPE, source="x")
    entries = doc["pace"]["high_heads"]
    assert list(entries) == [str(layer) for layer in SHAPE.gdn_layers]
    assert entries["4"] == {"gdn_layer": 3, "heads": list(heads[3])}  # decoder layer 3 is full attention
    assert document_from_json(json.dumps(doc)).config == cfg
    with pytest.raises(PaceError, match="decoder layer"):
        export_document(cfg)  # heads without the model they were chosen on
    wrong = json.loads(json.dumps(doc))
    wrong["pace"]["high_heads"]["3"] = wrong["pace"]["high_heads"].pop("4")
    with pytest.raises(PaceError, match="GDN layer 3"):
        document_from_json(json.dumps(wrong))


def test_layout_and_resident_bits_are_named():
    cfg = get_config("pace-4-8")
    doc = export_document(cfg, shape=SHAPE)
    assert doc["state_layout"]["tensor"].startswith("S [HV, K, V]") and doc["state_layout"]["groups_along"] == "key"
    assert "[slots, HV, V, K]" in doc["state_layout"]["engines"]
    r = resident_bits(cfg, SHAPE)
    assert doc["resident_bits"]["resident_bits"] == r.resident_bits == pytest.approx(6.7822265625)
    assert doc["resident_bits"]["c"] == r.c and doc["resident_bits"]["decode_period"] == 8
    assert export_document(get_config("qmamba-dsq"))["state_layout"]["groups_along"] == "rows and columns"
    assert export_document(cfg)["resident_bits"] is None and export_document(cfg)["model"] is None


def test_file_name_is_the_configuration_name():
    assert export_filename(get_config("pace-4")) == "pace-4.json"
    assert export_filename(get_config("pace-4").replace(name="my config / v2")) == "my-config-v2.json"


def test_a_file_for_another_model_is_refused():
    doc = document_from_json(export_json(get_config("pace-4"), shape=SHAPE, source="27b", weights_fingerprint="aa"))
    check_model(doc, SHAPE, "aa")
    check_model(doc, SHAPE)  # no fingerprint at hand: the shape alone
    with pytest.raises(PaceError, match="num_v_heads 48 in the file, 32 in the model"):
        check_model(doc, get_shape("qwen3.5-9b"))
    with pytest.raises(PaceError, match="other weights"):
        check_model(doc, SHAPE, "bb")


def test_malformed_exports_name_the_problem():
    doc = export_document(get_config("pace-4"), shape=SHAPE)
    for change, message in [({"kind": "x"}, "kind"), ({"extra": 1}, "unknown fields extra"),
                            ({"pace": {**doc["pace"], "bogus": 1}}, "pace.bogus is unknown"),
                            ({"model": {"source": "x"}}, "the field model")]:
        with pytest.raises(PaceError, match=message):
            document_from_json(json.dumps({**doc, **change}))
    missing = {**doc, "pace": {k: v for k, v in doc["pace"].items() if k != "buffer_precision"}}
    missing["pace"]["decode_period"] = 8
    with pytest.raises(PaceError, match="buffer"):
        document_from_json(json.dumps({**missing, "pace": {k: v for k, v in missing["pace"].items()
                                                          if k != "exact_current_token"}}))


def test_complete_records_of_earlier_schemas_still_read():
    cfg = get_config("pace-4-8")
    assert document_from_json(config_to_json(cfg, model="m")).config == cfg
