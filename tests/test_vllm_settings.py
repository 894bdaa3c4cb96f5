"""pace_core.vllm.settings: the configuration a vLLM engine serves is admitted as every configuration is
(pace_core.export.admit) against the engine's model; no vLLM needed (the engine's settings are stand-ins)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
from app_support import EMBEDDED_DIR

from pace_core.config import get_config
from pace_core.errors import PaceError
from pace_core.export import export_document
from pace_core.heads import num_high_heads
from pace_core.shapes import load_shape
from pace_core.vllm.settings import served

HF_CONFIG = (EMBEDDED_DIR / "config.json").read_text()
SHAPE = load_shape(str(EMBEDDED_DIR))


def _engine(source: str | None) -> SimpleNamespace:
    """A stand-in of vLLM's VllmConfig serving the embedded model's architecture with ``source``."""
    hf = SimpleNamespace(to_json_string=lambda use_diff: HF_CONFIG)
    return SimpleNamespace(
        additional_config={"pace_config": source} if source else {},
        cache_config=SimpleNamespace(enable_prefix_caching=False, mamba_cache_mode="none"),
        model_config=SimpleNamespace(enforce_eager=True, hf_config=hf),
        speculative_config=None, kv_transfer_config=None, parallel_config=SimpleNamespace(tensor_parallel_size=1))


def _file(tmp_path, shape, name: str, edit=None) -> str:
    n = num_high_heads(0.25, shape.num_v_heads)
    cfg = get_config("pace-4-8").replace(high_heads=tuple(tuple(range(n)) for _ in range(shape.num_gdn_layers)))
    doc = export_document(cfg, shape=shape, source="m", weights_fingerprint="f" * 16)
    if edit is not None:
        edit(doc)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_the_engine_serves_a_file_made_for_its_model(tmp_path, monkeypatch):
    monkeypatch.delenv("PACE_CONFIG", raising=False)
    assert served(_engine(None)) is None
    found = served(_engine(_file(tmp_path, SHAPE, "mine")))
    assert found.cfg.high_heads is not None and sorted(found.layouts) == [(layer, 0) for layer in SHAPE.gdn_layers]


@pytest.mark.parametrize("change, message", [
    (lambda d: d["pace"].update(bits=99), "pace.bits is not allowed"),
    (lambda d: d["state_layout"].update(groups_along="value"), "contradicts"),
])
def test_a_file_whose_sections_disagree_is_refused(tmp_path, change, message):
    with pytest.raises(PaceError, match=message):
        served(_engine(_file(tmp_path, SHAPE, "edited", change)))


def test_a_file_for_another_model_or_one_that_needs_calibrating_is_refused(tmp_path):
    twelve = dataclasses.replace(SHAPE, num_layers=12, num_gdn_layers=9, gdn_layers=(0, 1, 2, 4, 5, 6, 8, 9, 10))
    with pytest.raises(PaceError, match="num_layers 12 in the file, 8 in the model"):
        served(_engine(_file(tmp_path, twelve, "twelve")))
    with pytest.raises(PaceError, match="does not say which"):
        served(_engine("pace-4-8"))
    with pytest.raises(PaceError, match="cannot be served from a state pool"):
        served(_engine("damp-int4"))
