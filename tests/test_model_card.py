"""pace_core.model.card: a checkpoint's card is what a load measured, found again only while the folder
is unchanged (to the fingerprint's resolution) and for a load in the same dtype, and the embedded model's
shipped card is its current load's."""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pace_core.model import DEFAULT_MODEL_DIR
from pace_core.model.card import LOAD_ONLY_FIELDS, STAMP_EDGE_VALUES, card_of, checkpoint_stamp, load_card, save_card
from pace_core.model.loading import FINGERPRINT_VALUES, load_model
from pace_core.results import REPO_ROOT

SHIPPED_RESULTS = REPO_ROOT / "data" / "results"


@pytest.fixture()
def checkpoint(tiny_checkpoints, tmp_path) -> Path:
    """A copy of a tiny checkpoint that the test may change."""
    return shutil.copytree(tiny_checkpoints["qwen3_5"], tmp_path / "ckpt")


def _saved(folder: Path, root: Path, dtype: str = "float32"):
    before = checkpoint_stamp(folder)
    loaded = load_model(folder, dtype=dtype)
    assert save_card(loaded, "ckpt", before, root=root)
    return loaded


def test_a_saved_card_is_what_the_load_measured(checkpoint, tmp_path):
    assert STAMP_EDGE_VALUES == FINGERPRINT_VALUES  # the stamp sees what the fingerprint reads
    root = tmp_path / "results"
    assert load_card(checkpoint, "ckpt", "float32", root=root) is None
    loaded = _saved(checkpoint, root)
    card = load_card(checkpoint, "ckpt", "float32", root=root)
    assert card == card_of(loaded) and card.fingerprint == loaded.fingerprint and card.shape == loaded.shape
    assert card.summary == {k: v for k, v in loaded.summary().items() if k not in LOAD_ONLY_FIELDS}
    assert load_card(checkpoint, "ckpt", "bfloat16", root=root) is None  # another dtype reads other values
    # a copy of the folder elsewhere (a clone of the repository) finds it too, and names where it is now
    moved = shutil.copytree(checkpoint, tmp_path / "elsewhere" / "ckpt")
    found = load_card(moved, "ckpt", "float32", root=root)
    assert found.fingerprint == card.fingerprint and found.source == str(moved) == found.summary["source"]
    assert card.shape.name == str(checkpoint) and found.shape == dataclasses.replace(card.shape, name=str(moved))


def _rewrite_one_value(path: Path, which: str) -> None:
    """One float32 weight of the largest tensor of a safetensors file changed in place (header and every other
    byte kept): its first, a middle or its last value."""
    with open(path, "r+b") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
        info = max((v for k, v in header.items() if k != "__metadata__"),
                   key=lambda v: v["data_offsets"][1] - v["data_offsets"][0])
        assert info["dtype"] == "F32"
        begin, stop = info["data_offsets"]
        count = (stop - begin) // 4
        at = 8 + size + begin + 4 * {"first": 0, "middle": count // 2, "last": count - 1}[which]
        f.seek(at)
        value = struct.unpack("<f", f.read(4))[0]
        f.seek(at)
        f.write(struct.pack("<f", value + 1.0))


@pytest.mark.parametrize("change", ["config", "first value", "last value", "new weights file", "bin weights"])
def test_a_change_the_fingerprint_sees_hides_the_card(checkpoint, tmp_path, change):
    root = tmp_path / "results"
    _saved(checkpoint, root)
    weights = sorted(checkpoint.glob("*.safetensors"))[0]
    if change == "config":
        config = checkpoint / "config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "rms_norm_eps": 1e-5}))
    elif change == "new weights file":
        save_file({"extra": torch.zeros(3)}, checkpoint / "extra.safetensors")
    elif change == "bin weights":
        (checkpoint / "pytorch_model.bin").write_bytes(b"x")  # a format the stamp does not read: no card
    else:
        _rewrite_one_value(weights, change.split()[0])
    assert load_card(checkpoint, "ckpt", "float32", root=root) is None


def test_an_edit_inside_tensors_goes_unseen_as_by_the_fingerprint(checkpoint, tmp_path):
    """The stamp's resolution is the fingerprint's: a value in the middle of a tensor is seen by neither."""
    root = tmp_path / "results"
    loaded = _saved(checkpoint, root)
    _rewrite_one_value(sorted(checkpoint.glob("*.safetensors"))[0], "middle")
    assert load_card(checkpoint, "ckpt", "float32", root=root).fingerprint == loaded.fingerprint
    assert load_model(checkpoint).fingerprint == loaded.fingerprint


def test_nothing_is_stored_where_the_card_would_not_be_the_loads(checkpoint, tmp_path):
    root = tmp_path / "results"
    before = checkpoint_stamp(checkpoint)
    loaded = load_model(checkpoint)
    assert checkpoint_stamp("Qwen/Qwen3.5-4B") is None and checkpoint_stamp(tmp_path / "nowhere") is None
    assert not save_card(loaded, "ckpt", None, root=root)  # a hub id: no stamp
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    assert not save_card(loaded, "ckpt", before, root=blocked)  # the results root cannot be made
    offloaded = load_model(checkpoint)
    head = offloaded.model.get_output_embeddings()
    head.weight = torch.nn.Parameter(torch.empty(head.weight.shape, device="meta"))  # as device_map offloads
    assert not save_card(offloaded, "ckpt", before, root=root)  # the fingerprint counts it by name only
    _rewrite_one_value(sorted(checkpoint.glob("*.safetensors"))[0], "first")  # rewritten during the load
    assert not save_card(loaded, "ckpt", before, root=root)
    assert not root.exists()
    broken = checkpoint / "model.safetensors"
    broken.write_bytes(struct.pack("<Q", 10**6) + b"{")  # a header longer than the file: not safetensors
    assert checkpoint_stamp(checkpoint) is None


def test_damaged_cards_are_not_read(checkpoint, tmp_path):
    root = tmp_path / "results"
    _saved(checkpoint, root)
    stored, = (root / "ckpt").glob("model_card-*.json")
    doc = json.loads(stored.read_text())
    doc["data"]["shape"]["num_k_heads"] = 3  # no longer divides the value heads: not a shape
    stored.write_text(json.dumps(doc))
    assert load_card(checkpoint, "ckpt", "float32", root=root) is None
    stored.write_text("{not json")
    assert load_card(checkpoint, "ckpt", "float32", root=root) is None


@pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "config.json").exists(), reason="the embedded model is not trained")
def test_the_shipped_card_of_the_embedded_model_is_its_load():
    """data/results/pace-tiny-qwen35/model_card-*.json (``python -m pace_core card --out data/results``) must be
    regenerated whenever the embedded model changes: else the Overview loads the model (and this test fails).
    Read from the repository's own results (the tests write into a copy, conftest.py)."""
    found = load_card(DEFAULT_MODEL_DIR, str(DEFAULT_MODEL_DIR), "float32", root=SHIPPED_RESULTS)
    assert found == card_of(load_model())


@pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "config.json").exists(), reason="the embedded model is not trained")
def test_a_cards_provenance_names_the_model_as_another_machine_finds_it(tmp_path):
    """Not this machine's absolute path: the repository-relative folder (what result keys use too)."""
    loaded = load_model(DEFAULT_MODEL_DIR)
    assert save_card(loaded, str(DEFAULT_MODEL_DIR), checkpoint_stamp(DEFAULT_MODEL_DIR), root=tmp_path)
    [doc] = [json.loads(p.read_text()) for p in tmp_path.rglob("model_card-*.json")]
    assert doc["provenance"]["model"] == doc["model"] == "data/models/pace-tiny-qwen35" == loaded.reference
