"""pace_core.model.card: a checkpoint's card is what a load measured, found again only while the folder
is unchanged, and the embedded model's shipped card is its current load's."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from pace_core.model import DEFAULT_MODEL_DIR
from pace_core.model.card import LOAD_ONLY_FIELDS, STAMP_EDGE_BYTES, card_of, checkpoint_stamp, load_card, save_card
from pace_core.model.loading import load_model


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints, tmp_path_factory):
    """A copy of a tiny checkpoint that a test may change (module scope: copied once, restored by tests)."""
    folder = tmp_path_factory.mktemp("card") / "ckpt"
    shutil.copytree(tiny_checkpoints["qwen3_5"], folder)
    return folder


def test_a_saved_card_is_what_the_load_measured(checkpoint, tmp_path):
    loaded = load_model(checkpoint)
    card = card_of(loaded)
    assert card.fingerprint == loaded.fingerprint and card.shape == loaded.shape
    assert card.summary == {k: v for k, v in loaded.summary().items() if k not in LOAD_ONLY_FIELDS}
    assert load_card(checkpoint, "ckpt", root=tmp_path) is None
    assert save_card(card, "ckpt", root=tmp_path)
    assert load_card(checkpoint, "ckpt", root=tmp_path) == card
    # a copy of the folder elsewhere (a clone of the repository) finds it too, and names where it is now
    moved = shutil.copytree(checkpoint, tmp_path / "elsewhere" / "ckpt")
    found = load_card(moved, "ckpt", root=tmp_path)
    assert found.fingerprint == card.fingerprint and found.source == str(moved) == found.summary["source"]
    assert card.shape.name == str(checkpoint) and found.shape == dataclasses.replace(card.shape, name=str(moved))


@pytest.mark.parametrize("change", ["config", "weights head", "weights tail", "weights size", "new weights file"])
def test_any_change_of_config_or_weights_edges_hides_the_card(checkpoint, tmp_path, change):
    card = card_of(load_model(checkpoint))
    assert save_card(card, "ckpt", root=tmp_path)
    weights = sorted(checkpoint.glob("*.safetensors"))[0]
    config, original = checkpoint / "config.json", weights.read_bytes()
    config_text = config.read_text()
    try:
        if change == "config":
            config.write_text(json.dumps({**json.loads(config_text), "rms_norm_eps": 1e-5}))
        elif change == "weights size":
            weights.write_bytes(original + b"\0")
        elif change == "new weights file":
            (checkpoint / "extra.safetensors").write_bytes(b"x")
        else:  # one byte flipped inside the first / last STAMP_EDGE_BYTES
            at = min(len(original) - 1, 4096) if change == "weights head" else len(original) - 3
            assert at < STAMP_EDGE_BYTES or at >= len(original) - STAMP_EDGE_BYTES
            weights.write_bytes(original[:at] + bytes([original[at] ^ 1]) + original[at + 1:])
        assert load_card(checkpoint, "ckpt", root=tmp_path) is None
    finally:
        config.write_text(config_text)
        weights.write_bytes(original)
        (checkpoint / "extra.safetensors").unlink(missing_ok=True)
    assert load_card(checkpoint, "ckpt", root=tmp_path) == card


def test_hub_ids_damaged_cards_and_unwritable_folders(checkpoint, tmp_path):
    card = card_of(load_model(checkpoint))
    assert checkpoint_stamp("Qwen/Qwen3.5-4B") is None
    hub = dataclasses.replace(card, source="Qwen/Qwen3.5-4B")
    assert not save_card(hub, "Qwen/Qwen3.5-4B", root=tmp_path) and not any(tmp_path.iterdir())
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    assert not save_card(card, "ckpt", root=blocked)  # the results root cannot be made: nothing stored
    assert save_card(card, "ckpt", root=tmp_path)
    stored, = (tmp_path / "ckpt").glob("model_card-*.json")
    doc = json.loads(stored.read_text())
    doc["data"]["shape"]["num_k_heads"] = 3  # no longer divides the value heads: not a shape
    stored.write_text(json.dumps(doc))
    assert load_card(checkpoint, "ckpt", root=tmp_path) is None
    stored.write_text("{not json")
    assert load_card(checkpoint, "ckpt", root=tmp_path) is None


@pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "config.json").exists(), reason="the embedded model is not trained")
def test_the_shipped_card_of_the_embedded_model_is_its_load():
    """data/results/pace-tiny-qwen35/model_card-*.json (``python -m pace_core card``) must be regenerated
    whenever the embedded model changes: else the Overview loads the model (and this test fails)."""
    loaded = load_model()
    found = load_card(DEFAULT_MODEL_DIR, str(DEFAULT_MODEL_DIR))
    assert found == card_of(loaded)
