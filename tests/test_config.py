import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pace_core import __version__
from pace_core.config import METHOD_SETTINGS, NAMED_CONFIGS, SETTING_OF, SETTINGS, PaceConfig, get_config
from pace_core.errors import PaceError
from pace_core.export import (
    SCHEMA_VERSION,
    config_from_dict,
    config_from_json,
    config_to_dict,
    config_to_json,
    document_from_json,
)
from pace_core.heads import num_high_heads
from pace_core.methods import COMBINATIONS, METHODS
from pace_core.quant import QuantSpec
from pace_core.shapes import BUILTIN_SHAPES, ModelShape


def test_named_configurations_of_the_spec():
    spec = ["fp32", "bf16", *[f"rtn-int{b}" for b in range(2, 9)], "pace-4", "pace-4-8", "damp-int8", "damp-int4",
            "qmamba-dsq"]
    assert [name for name in NAMED_CONFIGS if name in spec] == spec
    assert list(NAMED_CONFIGS) == [name for m in METHODS.values() for name in m.named]  # each method's, in order
    for name, cfg in NAMED_CONFIGS.items():
        assert cfg.name == name
    fp32, bf16 = get_config("fp32"), get_config("bf16")
    assert (fp32.method, fp32.bits, fp32.reference_dtype, fp32.quantized) == ("none", 32, "float32", False)
    assert (bf16.method, bf16.bits, bf16.reference_dtype, bf16.quantized) == ("none", 16, "bfloat16", False)
    for b in range(2, 9):
        c = get_config(f"rtn-int{b}")
        assert (c.method, c.bits, c.group_axis, c.group_size, c.symmetric, c.decode_period, c.high_share) == \
               ("rtn", b, "value", 32, True, 1, 0.0)
        assert not c.buffered
        assert c.replace(decode_period=8).buffer == "int8"  # spec §6: RTN-INTb, dP uses an int8 buffer
    p4 = get_config("pace-4")
    assert (p4.method, p4.bits, p4.group_axis, p4.group_size, p4.symmetric, p4.decode_period, p4.prefill_period,
            p4.buffer, p4.high_share) == ("pace", 4, "key", 64, True, 8, 256, "int8", 0.0)
    p48 = get_config("pace-4-8")
    assert (p48.bits, p48.high_bits, p48.high_share, p48.group_axis, p48.group_size, p48.symmetric,
            p48.decode_period, p48.prefill_period, p48.buffer) == (4, 8, 0.25, "key", 32, False, 8, 256, "mixed")
    for b in (8, 4):
        d = get_config(f"damp-int{b}")
        assert (d.method, d.bits, d.decode_period, d.group_axis, d.group_size, d.symmetric, d.damp_outlier_rows,
                d.damp_hadamard) == ("damp", b, 1, "value", 32, True, 16, True)
    dsq = get_config("qmamba-dsq")
    assert (dsq.method, dsq.bits, dsq.decode_period, dsq.symmetric) == ("dsq", 4, 1, True)
    assert get_config(" PACE-4-8 ") is p48


def test_unknown_name_lists_the_names():
    with pytest.raises(PaceError) as e:
        get_config("pace-5")
    assert "pace-5" in str(e.value) and "allowed" in str(e.value)
    for name in NAMED_CONFIGS:
        assert name in str(e.value)


@pytest.mark.parametrize("changes, field, allowed", [
    ({"bits": 9}, "bits", "2..8"),
    ({"bits": 1}, "bits", "2..8"),
    ({"bits": 4.0}, "bits", "2..8"),
    ({"bits": True}, "bits", "2..8"),
    ({"method": "gptq"}, "method", "'pace'"),
    ({"group_size": 48}, "group_size", "powers of two dividing 128"),
    ({"group_size": 256}, "group_size", "powers of two dividing 128"),
    ({"group_size": 0}, "group_size", "64"),
    ({"decode_period": 0}, "decode_period", "1..4096"),
    ({"decode_period": 4097}, "decode_period", "1..4096"),
    ({"prefill_period": 0}, "prefill_period", "1.."),
    ({"buffer": "fp16"}, "buffer", "'mixed'"),
    ({"group_axis": "row"}, "group_axis", "'key'"),
    ({"high_share": 1.5}, "high_share", "[0, 1]"),
    ({"high_share": -0.1}, "high_share", "[0, 1]"),
    ({"high_bits": 3}, "high_bits", "4..8"),
    ({"scale_dtype": "float32"}, "scale_dtype", "'float16'"),
    ({"symmetric": 1}, "symmetric", "True"),
    ({"name": " "}, "name", "non-empty"),
    ({"reference_dtype": "float16"}, "reference_dtype", "'bfloat16'"),
    ({"damp_outlier_rows": 129}, "damp_outlier_rows", "0..128"),
    ({"damp_hadamard": 1}, "damp_hadamard", "True, False"),
])
def test_bad_settings_name_the_field_and_allowed_values(changes, field, allowed):
    with pytest.raises(PaceError) as e:
        get_config("damp-int4" if field.startswith("damp") else "pace-4").replace(**changes)
    msg = str(e.value)
    assert msg.startswith(field) and "allowed" in msg and allowed in msg


def test_method_specific_rules():
    with pytest.raises(PaceError, match="bits=4 is not allowed for method 'none'.*allowed: 32"):
        get_config("fp32").replace(bits=4)
    with pytest.raises(PaceError, match="allowed: 16"):
        get_config("fp32").replace(reference_dtype="bfloat16")
    assert get_config("fp32").replace(reference_dtype="bfloat16", bits=16) == get_config("bf16").replace(name="fp32")
    with pytest.raises(PaceError, match="high_share=0.25 is not allowed for method 'dsq'"):
        get_config("qmamba-dsq").replace(high_share=0.25)
    with pytest.raises(PaceError, match="symmetric=False is not allowed for method 'damp'"):
        get_config("damp-int4").replace(symmetric=False)
    with pytest.raises(PaceError, match="group_axis='key' is not allowed for method 'damp'"):
        get_config("damp-int4").replace(group_axis="key")
    with pytest.raises(PaceError, match="high_heads is set but high_share is 0"):
        get_config("pace-4").replace(high_heads=((0,),))
    with pytest.raises(PaceError, match=r"high_heads\[1\]"):
        get_config("pace-4-8").replace(high_heads=((0, 1), (3, 2)))
    with pytest.raises(PaceError, match=r"high_heads\[0\]"):
        get_config("pace-4-8").replace(high_heads=((1, 1),))
    with pytest.raises(PaceError, match="unknown setting.*dp.*allowed: .*decode_period"):
        get_config("pace-4").replace(dp=8)


def test_combinations_only_for_the_methods_that_take_them():
    """Stochastic rounding (RTN, PACE, DSQ, DAMP), the key rotation (RTN, PACE, DSQ) and static scales (RTN, PACE) are
    each a setting the methods that compose with them take; elsewhere a PaceError names the methods that do."""
    takes = {name: [m for m, method in METHODS.items() if name in method.composes] for name in COMBINATIONS}
    assert takes == {"rounding": ["rtn", "pace", "damp", "dsq"], "key_hadamard": ["rtn", "pace", "dsq"],
                     "scales": ["rtn", "pace"]}
    on = {"rounding": "stochastic", "key_hadamard": True, "scales": "static"}
    for name, value in on.items():
        for cfg in NAMED_CONFIGS.values():
            if cfg.method in takes[name]:
                assert set(cfg.replace(**{name: value}).combined) == {*cfg.combined, name}
            else:
                with pytest.raises(PaceError, match=f"{name}={value!r} is not allowed for method {cfg.method!r}; "
                                                    f"allowed: .*the methods that take.*{', '.join(takes[name])}"):
                    cfg.replace(**{name: value})
    assert [get_config(n).combined for n in ("pace-4", "pace-4-sr", "pace-4-hadamard", "pace-4-static")] == [
        (), ("rounding",), ("key_hadamard",), ("scales",)]
    for name in ("pace-4-sr", "pace-4-hadamard", "pace-4-static"):  # PACE-4 and one combination
        assert get_config(name).replace(name="pace-4", rounding="nearest", key_hadamard=False,
                                        scales="dynamic") == get_config("pace-4")
    for changes, field, allowed in [(dict(rounding="dithered"), "rounding", "'nearest', 'stochastic'"),
                                    (dict(rounding_seed=2**16), "rounding_seed", "0..65535"),
                                    (dict(scales="fixed"), "scales", "'dynamic', 'static'"),
                                    (dict(static_margin=0.2), "static_margin", "[0.25, 16]"),
                                    (dict(key_hadamard=1), "key_hadamard", "True, False")]:
        with pytest.raises(PaceError, match=f"^{field}=.*allowed: .*{allowed}"):
            get_config("pace-4").replace(**changes)
    assert get_config("pace-4").replace(static_margin=2).static_margin == 2.0
    get_config("pace-4-hadamard").validate_for(_shape(d_v=96))
    with pytest.raises(PaceError, match="key_hadamard=True needs a power-of-two d_k; test has d_k=96"):
        get_config("pace-4-hadamard").replace(group_size=32).validate_for(_shape(d_k=96))


def test_records_of_schema_5_read_without_the_combinations():
    """A schema 5 record (before the combinations) reads as their defaults: the plain storage it was made with."""
    d = _doc(schema_version=5)
    assert not {"rounding", "rounding_seed", "key_hadamard", "scales", "static_margin"} & set(d["pace"])
    assert config_from_dict(d) == get_config("pace-4-8")
    sr = config_to_dict(get_config("pace-4-sr").replace(rounding_seed=9))
    assert (sr["pace"]["rounding"], sr["pace"]["rounding_seed"]) == ("stochastic", 9)
    assert config_from_dict(sr) == get_config("pace-4-sr").replace(rounding_seed=9)


def test_frozen_validated_copy_and_list_normalisation():
    cfg = get_config("pace-4-8")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.bits = 3  # type: ignore[misc]
    new = cfg.replace(decode_period=32, high_heads=[[0, 5], [1, 2]])
    assert new.decode_period == 32 and new.high_heads == ((0, 5), (1, 2)) and cfg.decode_period == 8
    assert hash(new) == hash(cfg.replace(decode_period=32, high_heads=((0, 5), (1, 2))))
    assert PaceConfig(high_share=1).high_share == 1.0 and isinstance(PaceConfig(high_share=1).high_share, float)
    assert cfg.validate() is cfg


def _shape(d_k: int = 128, d_v: int = 128, hv: int = 48, layers: int = 2) -> ModelShape:
    return ModelShape("test", layers + 1, layers, 16, hv, d_k, d_v, 1000)


def test_validate_for_checks_the_model():
    s27 = BUILTIN_SHAPES["qwen3.5-27b"]
    for cfg in NAMED_CONFIGS.values():
        assert cfg.validate_for(s27) is cfg
    with pytest.raises(PaceError) as e:
        get_config("pace-4").validate_for(_shape(d_k=96))
    assert "group_size=64 does not divide the key axis" in str(e.value) and "d_k=96" in str(e.value)
    assert str(e.value).endswith("allowed: 1, 2, 4, 8, 16, 32")  # group sizes that also pass validate()
    get_config("pace-4").validate_for(_shape(d_v=96))  # key groups do not care about d_v
    get_config("rtn-int4").validate_for(_shape(d_v=96))  # 32 divides 96
    with pytest.raises(PaceError, match="group_size=64 does not divide the value axis.*d_v=96"):
        get_config("rtn-int4").replace(group_size=64).validate_for(_shape(d_v=96))
    with pytest.raises(PaceError, match="damp_outlier_rows=16 exceeds d_k=8"):
        get_config("damp-int4").validate_for(_shape(d_k=8, d_v=64))
    with pytest.raises(PaceError, match="damp_hadamard=True needs a power-of-two d_v"):
        get_config("damp-int4").validate_for(_shape(d_v=96))
    get_config("damp-int4").replace(damp_hadamard=False).validate_for(_shape(d_v=96))
    cfg = get_config("pace-4-8")
    good = cfg.replace(high_heads=(tuple(range(0, 48, 4)), tuple(range(36, 48))))
    assert good.validate_for(_shape()) is good
    with pytest.raises(PaceError, match="high_heads has 1 layers; allowed: one per GDN layer of test \\(2\\)"):
        cfg.replace(high_heads=(tuple(range(12)),)).validate_for(_shape())
    with pytest.raises(PaceError, match=r"high_heads\[1\].*allowed: 12 distinct head indices in 0..47"):
        cfg.replace(high_heads=(tuple(range(12)), tuple(range(37, 49)))).validate_for(_shape())
    with pytest.raises(PaceError, match=r"high_heads\[0\].*allowed: 12"):
        cfg.replace(high_heads=(tuple(range(11)), tuple(range(12)))).validate_for(_shape())


def test_num_high_heads_rounds_half_up():
    assert num_high_heads(0.25, 48) == 12 and num_high_heads(0.25, 32) == 8
    assert num_high_heads(0.25, 6) == 2 and num_high_heads(0.25, 2) == 1 and num_high_heads(0.2, 2) == 0
    assert num_high_heads(0.0, 32) == 0 and num_high_heads(1.0, 32) == 32


def test_quant_spec_and_head_bits():
    cfg = get_config("pace-4-8")
    assert cfg.quant_spec() == QuantSpec(bits=4, symmetric=False, axis="key", group_size=32)
    assert cfg.quant_spec(8).bits == 8
    with pytest.raises(PaceError, match="method 'dsq' has no group quantiser"):
        get_config("qmamba-dsq").quant_spec()
    assert get_config("pace-4").head_bits(0, 4) == (4, 4, 4, 4)
    with pytest.raises(PaceError, match="needs high_heads from calibration"):
        cfg.head_bits(0, 8)
    cal = cfg.replace(high_heads=((1, 6), (0, 7)))
    assert cal.head_bits(0, 8) == (4, 8, 4, 4, 4, 4, 8, 4)
    assert cal.head_bits(1, 8) == (8, 4, 4, 4, 4, 4, 4, 8)
    with pytest.raises(PaceError, match="gdn_layer=2 is out of range"):
        cal.head_bits(2, 8)


def test_json_document_is_shaped_like_a_kv_cache_scheme():
    cfg = get_config("pace-4-8").replace(high_heads=((2, 9), (0, 1)))
    d = config_to_dict(cfg, model="qwen3.5-27b", provenance={"calibration": "wikitext2-valid.txt"})
    assert d["schema_version"] == SCHEMA_VERSION == 7
    assert d["producer"] == {"name": "pace-studio", "version": __version__}
    assert d["model"] == "qwen3.5-27b"
    assert d["state_cache_scheme"] == {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                                       "group_size": 32, "scale_dtype": "float16", "zp_dtype": "int4"}
    assert d["pace"] == {"name": "pace-4-8", "method": "pace", "group_axis": "key", "decode_period": 8,
                         "prefill_period": 256, "buffer_precision": "mixed", "high_bits": 8, "high_share": 0.25,
                         "high_heads": {"0": [2, 9], "1": [0, 1]}, "reference_dtype": "float32",
                         "damp_outlier_rows": 16, "damp_hadamard": True, "prefill_after_decode": "flush",
                         "exact_current_token": True, "buffer_key_group": 16, "buffer_value_group": 0,
                         "buffer_key_symmetric": False, "buffer_value_symmetric": True, "calibrated": None,
                         "rounding": "nearest", "rounding_seed": 0, "key_hadamard": False, "scales": "dynamic",
                         "static_margin": 0.625,
                         **{SETTING_OF[name].json: st.default for name, st in METHOD_SETTINGS.items()}}
    assert d["provenance"] == {"calibration": "wikitext2-valid.txt"}
    assert json.loads(json.dumps(d)) == d
    assert config_to_dict(get_config("pace-4"))["state_cache_scheme"]["zp_dtype"] is None
    assert config_to_dict(get_config("qmamba-dsq"))["state_cache_scheme"]["strategy"] == "channel"
    ref = config_to_dict(get_config("bf16"))["state_cache_scheme"]
    assert (ref["type"], ref["num_bits"], ref["strategy"], ref["zp_dtype"]) == ("float", 16, None, None)


@pytest.mark.parametrize("name", list(NAMED_CONFIGS))
def test_named_configs_round_trip_exactly(name):
    cfg = get_config(name)
    assert config_from_dict(config_to_dict(cfg)) == cfg
    assert config_from_json(config_to_json(cfg, model="m", provenance={"x": 1})) == cfg


@st.composite
def configs(draw) -> PaceConfig:
    method = draw(st.sampled_from(["none", "rtn", "pace", "damp", "dsq"]))
    ref = draw(st.sampled_from(["float32", "bfloat16"]))
    bits = {"float32": 32, "bfloat16": 16}[ref] if method == "none" else draw(st.integers(2, 8))
    share = draw(st.floats(0, 1, allow_nan=False)) if method in ("rtn", "pace") else 0.0
    heads = None
    if share > 0 and draw(st.booleans()):
        layers = draw(st.lists(st.sets(st.integers(0, 63), max_size=6), min_size=1, max_size=4))
        heads = tuple(tuple(sorted(layer)) for layer in layers)
    damp = (
        dict(damp_outlier_rows=draw(st.integers(0, 128)), damp_hadamard=draw(st.booleans())) if method == "damp" else {}
    )
    return PaceConfig.make(
        **damp, name=draw(st.text("abcxyz-_.0123 ", min_size=1, max_size=12).filter(str.strip)),
        method=method, bits=bits, reference_dtype=ref,
        high_bits=draw(st.integers(bits if method != "none" else 2, 8)), high_share=share,
        symmetric=True if method in ("damp", "dsq") else draw(st.booleans()),
        group_axis="value" if method == "damp" else draw(st.sampled_from(["key", "value"])),
        group_size=draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128])),
        decode_period=draw(st.integers(1, 4096)), prefill_period=draw(st.integers(1, 1 << 20)),
        buffer=draw(st.sampled_from(["fp32", "bf16", "int8", "mixed"])),
        high_heads=heads,
        prefill_after_decode=draw(st.sampled_from(["flush", "carry"])),
        rounding=draw(st.sampled_from(["nearest", "stochastic"])) if method != "none" else "nearest",
        rounding_seed=draw(st.integers(0, 2**16 - 1)),
        key_hadamard=draw(st.booleans()) if method in ("rtn", "pace", "dsq") else False,
        scales=draw(st.sampled_from(["dynamic", "static"])) if method in ("rtn", "pace") else "dynamic",
        static_margin=draw(st.floats(0.25, 16, allow_nan=False)))


@settings(max_examples=150, deadline=None)
@given(cfg=configs(), model=st.one_of(st.none(), st.text(max_size=8)))
def test_generated_configs_round_trip_exactly(cfg, model):
    text = config_to_json(cfg, model=model, provenance={"seed": 1})
    assert config_from_json(text) == cfg
    doc = document_from_json(text)
    assert (doc.config, doc.model, doc.provenance) == (cfg, model, {"seed": 1})


def _doc(**changes) -> dict:
    """PACE-4/8's record with ``changes`` (``section__key``: a value, or KeyError to remove it); a record of an
    older ``schema_version`` lacks the methods' settings added at schema 5 or later (STEPQuant's; DAMP's are schema
    1's), before schema 6 the combinations' settings, before schema 7 STEPQuant's calibration samples."""
    d = config_to_dict(get_config("pace-4-8"))
    version = changes.get("schema_version", SCHEMA_VERSION)
    for setting in SETTINGS:
        if (setting.field in METHOD_SETTINGS and setting.schema >= 5 and version in (1, 2, 3)) or (
            setting.schema >= 6 and version in (1, 2, 3, 5)
        ) or (setting.schema == 7 and version == 6):
            del d["pace"][setting.json]
    for path, value in changes.items():
        *head, last = path.split("__")
        target = d
        for key in head:
            target = target[key]
        if value is KeyError:
            del target[last]
        else:
            target[last] = value
    return d


@pytest.mark.parametrize("changes, message", [
    ({"schema_version": 8}, "schema_version=8 is newer than this PACE Studio understands; allowed: 1..7"),
    ({"schema_version": 0}, "schema_version=0 is not allowed; allowed: 1..7"),
    ({"schema_version": 4}, "the document lacks kind"),  # a complete record labelled as an export
    ({"schema_version": "1"}, "schema_version='1' is not allowed"),
    ({"schema_version": KeyError}, "schema_version is missing"),
    ({"pace": KeyError}, "field pace is missing"),
    ({"pace": []}, "field 'pace' must be an object"),
    ({"provenance": "x"}, "field provenance must be an object"),
    ({"model": 3}, "field model=3 is not allowed"),
    ({"state_cache_scheme__num_bits": 9}, "bits=9 is not allowed"),
    ({"state_cache_scheme__group_size": KeyError}, "state_cache_scheme.group_size is missing"),
    ({"state_cache_scheme__observer": "minmax"}, "state_cache_scheme.observer is unknown"),
    ({"state_cache_scheme__strategy": "tensor"}, "state_cache_scheme.strategy='tensor' does not match"),
    ({"state_cache_scheme__zp_dtype": None}, "state_cache_scheme.zp_dtype=None does not match.*allowed: 'int4'"),
    ({"state_cache_scheme__type": "float"}, "type='float' does not match pace.method='pace'"),
    ({"state_cache_scheme__type": "fp"}, "state_cache_scheme.type='fp' is not allowed"),
    ({"pace__decode_period": 0}, "decode_period=0 is not allowed"),
    ({"pace__buffer_precision": "int4"}, "buffer='int4' is not allowed"),
    ({"pace__high_heads": {"0": [1], "2": [3]}}, "pace.high_heads has keys"),
    ({"pace__high_heads": {"0": [1.5]}}, r'pace.high_heads\["0"\]=\[1.5\]'),
    ({"pace__high_heads": []}, "pace.high_heads=\\[\\] is not allowed"),
    ({"pace__prefill_after_decode": "round"}, "prefill_after_decode='round' is not allowed; allowed: 'flush', 'carry'"),
    ({"pace__prefill_after_decode": KeyError}, "pace.prefill_after_decode is missing"),
    ({"schema_version": 1}, "pace.buffer_key_group, .*pace.exact_current_token, pace.prefill_after_decode, "
                            "pace.calibrated are unknown"),
    ({"schema_version": 2}, "pace.buffer_key_group, .*pace.exact_current_token, pace.calibrated are unknown"),
    ({"pace__buffer_key_group": 3}, "buffer_key_group=3"),
    ({"pace__exact_current_token": KeyError}, "pace.exact_current_token is missing"),
])
def test_malformed_documents_name_the_field(changes, message):
    with pytest.raises(PaceError, match=message):
        config_from_dict(_doc(**changes))


def test_older_documents_read_with_the_behaviour_they_were_made_with():
    """Documents of PACE Studio before ``prefill_after_decode`` (schema 1) read as flush; before the exact
    current token and buffer groups (schemas 1 and 2) as a token reading its own stored record from
    per-vector symmetric buffer scales."""
    before = dict(exact_current_token=False, buffer_key_group=0, buffer_key_symmetric=True)
    d = _doc(schema_version=1, pace__prefill_after_decode=KeyError, pace__exact_current_token=KeyError,
             pace__buffer_key_group=KeyError, pace__buffer_value_group=KeyError, pace__buffer_key_symmetric=KeyError,
             pace__buffer_value_symmetric=KeyError, pace__calibrated=KeyError)
    cfg = config_from_dict(d)
    assert cfg == get_config("pace-4-8").replace(**before) and cfg.prefill_after_decode == "flush"
    d2 = _doc(schema_version=2, pace__exact_current_token=KeyError, pace__buffer_key_group=KeyError,
              pace__buffer_value_group=KeyError, pace__buffer_key_symmetric=KeyError,
              pace__buffer_value_symmetric=KeyError, pace__calibrated=KeyError)
    assert config_from_dict(d2) == get_config("pace-4-8").replace(**before)
    with pytest.raises(PaceError, match="prefill_after_decode='later' is not allowed"):
        get_config("pace-4").replace(prefill_after_decode="later")
    shipped = Path(__file__).resolve().parents[1] / "data/models/pace-tiny-qwen35/eval/calibration_pace-4-8.json"
    stored = json.loads(shipped.read_text())["data"]["config"]
    assert stored["schema_version"] == 1 and "prefill_after_decode" not in stored["pace"]
    loaded = config_from_dict(stored)
    assert loaded.replace(high_heads=None) == get_config("pace-4-8").replace(name=stored["pace"]["name"], **before)


def test_malformed_json_text():
    with pytest.raises(PaceError, match="not valid JSON \\(line 2, column 1"):
        config_from_json('{"schema_version": 1,\n}')
    with pytest.raises(PaceError, match="config JSON must be an object; got list"):
        config_from_json("[1, 2]")
    with pytest.raises(PaceError, match="nested too deeply"):
        config_from_json("[" * 100_000)
    with pytest.raises(PaceError, match="config JSON must be text"):
        config_from_json(b"{}")  # type: ignore[arg-type]
    with pytest.raises(PaceError, match="provenance=.*allowed: a JSON object"):
        config_to_dict(get_config("pace-4"), provenance=[1])  # type: ignore[arg-type]
