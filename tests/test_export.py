"""pace_core.export: the deployable schema 4 document (model, layout, used settings, resident bits)."""

import dataclasses
import json

import pytest

from pace_core.accounting import resident_bits
from pace_core.cli.calibration import export_differences
from pace_core.config import NAMED_CONFIGS, PaceConfig, get_config
from pace_core.errors import PaceError
from pace_core.export import (
    admit,
    check_model,
    config_to_json,
    document_from_json,
    export_document,
    export_filename,
    export_json,
    read_config,
    used_fields,
    used_settings,
)
from pace_core.heads import num_high_heads
from pace_core.shapes import ModelShape, get_shape

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
    custom = get_config("pace-4").replace(high_bits=6, reference_dtype="bfloat16")  # read with a share; by method none
    assert used_settings(custom) == get_config("pace-4")
    # a combination is written where it is on, with the settings read with it
    combined = {"rounding", "rounding_seed", "key_hadamard", "scales", "static_margin", "calibrated"}
    assert not combined & set(used_fields(get_config("pace-4"))) and combined & set(damp) == {"calibrated"}  # its rows
    assert {"rounding", "rounding_seed"} == combined & set(used_fields(get_config("pace-4-sr")))
    assert {"key_hadamard"} == combined & set(used_fields(get_config("pace-4-hadamard")))
    assert {"scales", "static_margin", "calibrated"} == combined & set(used_fields(get_config("pace-4-static")))
    assert used_settings(get_config("pace-4-sr").replace(static_margin=2.0)) == get_config("pace-4-sr")
    sr = export_document(get_config("pace-4-sr"), shape=SHAPE)
    assert sr["schema_version"] == 7 and (sr["pace"]["rounding"], sr["pace"]["rounding_seed"]) == ("stochastic", 0)
    older = export_document(get_config("pace-4"), shape=SHAPE)
    older["schema_version"] = 5  # an export made before the combinations: the same keys, read as their defaults
    del older["state_layout"]["packing"]  # nor did it record the packing (schema 7)
    assert document_from_json(json.dumps(older)).config == get_config("pace-4")


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
    assert doc["state_layout"]["packing"] == "dense" and "little-endian bit stream" in doc["state_layout"]["codes"]
    assert export_document(get_config("fp32"))["state_layout"]["packing"] is None
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


def _heads(shape: ModelShape, share: float = 0.25) -> tuple[tuple[int, ...], ...]:
    n = num_high_heads(share, shape.num_v_heads)
    return tuple(tuple(range(i % 2, i % 2 + n)) for i in range(shape.num_gdn_layers))


EIGHT = ModelShape(name="eight", num_layers=8, num_gdn_layers=6, num_k_heads=2, num_v_heads=4, d_k=128, d_v=128,
                   weight_params=0, gdn_layers=(0, 1, 2, 4, 5, 6))
"""The embedded model's shape (8 decoder layers, 6 GDN)."""
TWELVE = dataclasses.replace(EIGHT, name="twelve", num_layers=12, num_gdn_layers=9,
                             gdn_layers=(0, 1, 2, 4, 5, 6, 8, 9, 10))


@pytest.mark.parametrize("shape, fingerprint, message", [
    (TWELVE, "aa", "num_layers 12 in the file, 8 in the model"),
    (dataclasses.replace(EIGHT, num_v_heads=8), "aa", "num_v_heads 8 in the file, 4 in the model"),
    (EIGHT, "bb", "other weights"),
])
def test_admit_refuses_a_file_for_another_model(tmp_path, shape, fingerprint, message):
    cfg = get_config("pace-4-8").replace(high_heads=_heads(shape))
    path = tmp_path / "other.json"
    path.write_text(export_json(cfg, shape=shape, source="other", weights_fingerprint=fingerprint))
    with pytest.raises(PaceError, match=message):
        admit(path, EIGHT, "aa")
    mine = tmp_path / "mine.json"
    mine.write_text(export_json(get_config("pace-4-8").replace(high_heads=_heads(EIGHT)), shape=EIGHT,
                                source="mine", weights_fingerprint="aa"))
    assert admit(mine, EIGHT, "aa").high_heads == _heads(EIGHT)
    assert admit(mine, EIGHT).high_heads == _heads(EIGHT)  # no fingerprint at hand: the shape alone


def _exported(**changes) -> dict:
    """The export of PACE-4/8 with heads on EIGHT, with ``changes`` ({"section.key": value}) applied."""
    doc = export_document(get_config("pace-4-8").replace(high_heads=_heads(EIGHT)), shape=EIGHT, source="m")
    for where, value in changes.items():
        section, _, key = where.partition(".")
        if key:
            doc[section][key] = value
        else:
            doc[section] = value
    return doc


@pytest.mark.parametrize("changes, message", [
    ({"pace.bits": 99}, "pace.bits is not allowed: it is state_cache_scheme.num_bits"),
    ({"pace.group_size": 16}, "pace.group_size is not allowed: it is state_cache_scheme.group_size"),
    ({"pace.damp_outlier_rows": 4}, "damp_outlier_rows=4 is not allowed for method 'pace'.*a setting of method 'damp'"),
    ({"state_cache_scheme.type": "float"}, "state_cache_scheme.type='float' does not match pace.method='pace'"),
    ({"state_cache_scheme.zp_dtype": None}, "state_cache_scheme.zp_dtype=None does not match"),
    ({"state_layout.groups_along": "value"}, "state_layout.groups_along='value' contradicts"),
    ({"state_layout.group_size": 64}, "state_layout.group_size=64 contradicts"),
    ({"resident_bits.resident_bits": 4.25}, "resident_bits.resident_bits=4.25 contradicts"),
    ({"resident_bits.decode_period": 16}, "resident_bits.decode_period=16 contradicts"),
    ({"model.num_layers": 5}, "the field model describes no valid model"),
    ({"model.gdn_layers": [0, 1, 2]}, "names GDN layer 3, but the model's GDN layers are the decoder layers"),
    ({"model.num_v_heads": 16}, "the settings do not fit the file's own model"),
    ({"model.num_v_heads": 2}, "resident_bits.payload_bits=5.65625 contradicts"),
    ({"model": None, "resident_bits": None}, "pace.high_heads is not allowed without the field model"),
])
def test_contradictory_sections_are_refused(changes, message):
    with pytest.raises(PaceError, match=message.replace("(", r"\(").replace("[", r"\[")):
        read_config(_exported(**changes))


def test_resident_bits_and_heads_follow_the_model_block():
    with pytest.raises(PaceError, match="resident bits are counted on a model"):
        read_config(export_document(get_config("pace-4"), shape=None) | {"resident_bits": _exported()["resident_bits"]})
    doc = _exported()
    doc["pace"]["high_heads"].pop("6")  # one GDN layer of the model's six without its heads
    with pytest.raises(PaceError, match="high_heads has 5 layers; allowed: one per GDN layer of m"):
        read_config(doc)


def test_what_is_read_back_is_what_was_written():
    """Every named configuration's export, on a model and without, reads back consistent (the resident bits
    recorded at dP = 1 are those of the settings written, whatever buffer the configuration named)."""
    for named in NAMED_CONFIGS.values():
        for shape in (EIGHT, SHAPE, None):
            cfg = named.replace(high_heads=_heads(shape)) if named.needs_heads and shape is not None else named
            assert read_config(json.loads(export_json(cfg, shape=shape))).config == used_settings(cfg)


def test_admit_completes_what_needs_a_calibration_or_refuses():
    pace48 = get_config("pace-4-8")
    with pytest.raises(PaceError, match="does not say which"):
        admit("pace-4-8", EIGHT)
    with pytest.raises(PaceError, match="does not say which"):
        admit("pace-4-8", EIGHT, ready_for="run")
    assert admit("pace-4-8", EIGHT, ready_for="settings") == pace48  # the share alone: the app's sidebar, bits
    chosen = admit("pace-4-8", EIGHT, calibrate=lambda c: c.replace(high_heads=_heads(EIGHT)))
    assert chosen == pace48.replace(high_heads=_heads(EIGHT))
    with pytest.raises(PaceError, match="high_heads has 9 layers"):  # what a calibration returns is checked too
        admit("pace-4-8", EIGHT, calibrate=lambda c: c.replace(high_heads=_heads(TWELVE)))
    with pytest.raises(PaceError, match="outlier key rows"):
        admit("damp-int4", EIGHT)
    assert admit("damp-int4", EIGHT, ready_for="settings") == get_config("damp-int4")
    seen = []
    assert admit("damp-int4", EIGHT, calibrate=lambda c: seen.append(c) or c) == get_config("damp-int4")
    assert seen == [get_config("damp-int4")]
    with pytest.raises(PaceError, match="group_size=64 does not divide"):
        admit(get_config("pace-4"), dataclasses.replace(EIGHT, d_k=96))
    with pytest.raises(PaceError, match="ready_for='later' is not allowed"):
        admit("pace-4", ready_for="later")


def test_read_config_takes_every_form(tmp_path):
    cfg = get_config("rtn-int5").replace(name="mine", decode_period=4)
    text = export_json(cfg)
    (tmp_path / "mine.json").write_text(text)
    for form in (cfg, tmp_path / "mine.json", str(tmp_path / "mine.json"), text, json.loads(text),
                 read_config(text)):
        assert read_config(form).config == used_settings(cfg)
    assert read_config("PACE-4").config == get_config("pace-4")
    with pytest.raises(PaceError, match="config 'pace-5' is unknown; allowed: fp32"):
        read_config("pace-5")
    with pytest.raises(PaceError, match="cannot be read"):
        read_config(tmp_path / "missing.json")
    with pytest.raises(PaceError, match="int is not allowed"):
        read_config(3)


def test_the_evidence_a_configuration_was_picked_on_is_recorded_and_read_back():
    """provenance.evidence (issue 47): written with the file, read back as written, checked on both sides; a file
    without it (every file before) reads as before, and the configuration is the same with or without it."""
    evidence = {"axis": "task:k:gsm8k:exact_match:strict-match", "label": "gsm8k · exact_match (strict-match)",
                "higher_is_better": True, "config": "pace-4", "value": 0.52, "stderr": 0.014,
                "reference": {"config": "fp32", "value": 0.55}, "budget_bits": 6.0, "resident_bits": 4.6,
                "frontier": ["rtn-int2", "pace-4", "fp32"], "task": "gsm8k", "lm_eval": "0.4.13"}
    cfg = get_config("pace-4")
    plain = export_json(cfg, shape=SHAPE, source="m", provenance={"command": "x"})
    picked = export_json(cfg, shape=SHAPE, source="m", provenance={"command": "x"}, evidence=evidence)
    doc = document_from_json(picked)
    assert doc.provenance == {"command": "x", "evidence": evidence}
    assert "evidence" not in json.loads(plain)["provenance"]
    assert doc.config == document_from_json(plain).config and export_differences(plain.encode(), picked) == []
    for field, value, allowed in (("value", None, "a finite number"), ("frontier", "pace-4", "a list"),
                                  ("stderr", -1.0, "null or a number >= 0"), ("higher_is_better", 1, "a bool")):
        bad = {**evidence, field: value}
        with pytest.raises(PaceError, match=rf"provenance\.evidence\.{field}=.*allowed: {allowed}"):
            export_json(cfg, shape=SHAPE, evidence=bad)
        edited = json.loads(picked)
        edited["provenance"]["evidence"] = bad
        with pytest.raises(PaceError, match=rf"provenance\.evidence\.{field}"):
            document_from_json(json.dumps(edited))
    with pytest.raises(PaceError, match="provenance.evidence must be an object"):
        export_json(cfg, shape=SHAPE, evidence=["kl"])


def _schema6(name: str, padding: float) -> dict:
    """The export of ``name`` as schema 6 wrote it: no packing in the layout, the codes' padding (bits per value)
    counted in the metadata and the resident bits."""
    doc = export_document(get_config(name), shape=SHAPE, source="27b")
    doc["schema_version"] = 6
    del doc["state_layout"]["packing"], doc["state_layout"]["codes"]
    doc["state_layout"]["update"] = doc["state_layout"].pop("update")  # schema 6's key order
    for key in ("metadata_bits", "resident_bits"):
        doc["resident_bits"][key] += padding
    return doc


@pytest.mark.parametrize("name,padding", [("rtn-int2", 2.0), ("rtn-int3", 1.0), ("rtn-int5", 3.0), ("rtn-int6", 2.0),
                                          ("rtn-int7", 1.0), ("rtn-int4", 0.0), ("pace-4-8", 0.0)])
def test_a_file_of_the_padded_layout_is_migrated(name, padding):
    """A schema 6 export (codes of 2, 3, 5, 6, 7 bits stored padded to 4 or 8 bits, its resident bits counting the
    padding as metadata: rtn-int3 4.5 instead of 3.5) is read as the same settings, now stored densely; 4- and 8-bit
    files, whose bytes did not change, read as they are. Its resident bits must be the padded storage's: the same
    padding in the metadata and the total, every other term the settings'."""
    old = _schema6(name, padding)
    doc = document_from_json(json.dumps(old))
    assert doc.config == used_settings(get_config(name))
    assert export_document(doc.config, shape=SHAPE)["resident_bits"]["resident_bits"] == pytest.approx(
        old["resident_bits"]["resident_bits"] - padding)
    edited = json.loads(json.dumps(old))
    edited["resident_bits"]["resident_bits"] += 0.5  # padding in the total but not in the metadata
    with pytest.raises(PaceError, match="resident_bits.metadata_bits" if padding == 0 else
                       "neither the bits these settings store now .* nor those of its padded"):
        document_from_json(json.dumps(edited))
    with pytest.raises(PaceError, match="state_layout.packing is not allowed in a schema 6 file"):
        document_from_json(json.dumps({**old, "state_layout": {**old["state_layout"], "packing": "dense"}}))


def test_a_schema_7_file_must_name_the_packing():
    doc = export_document(get_config("rtn-int3"), shape=SHAPE)
    del doc["state_layout"]["packing"]
    with pytest.raises(PaceError, match="state_layout.packing=None contradicts"):
        document_from_json(json.dumps(doc))
    newer = {**export_document(get_config("rtn-int3"), shape=SHAPE), "schema_version": 8}
    with pytest.raises(PaceError, match="schema_version=8 is newer"):
        document_from_json(json.dumps(newer))


def test_the_shipped_schema_6_export_is_read():
    """data/results' PACE-4/8 export (schema 6, 4- and 8-bit codes: the same bytes densely packed) is read as is."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "data" / "results" / "pace-tiny-qwen35" / "config-pace-4-8.json"
    assert json.loads(path.read_text())["schema_version"] == 6
    assert read_config(path).config.name == "pace-4-8"
