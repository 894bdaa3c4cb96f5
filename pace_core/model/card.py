"""A checkpoint's card: what the Overview and Memory pages show of a model (its state geometry, its
architecture summary and its weights fingerprint) without loading it.

Loading a model means importing transformers' model code and reading every weight (seconds on a CPU,
minutes for a large checkpoint), yet these pages need only numbers a load has measured once. So every
load through ``python -m pace_core`` or the app stores a card in the results cache (kind ``model_card``,
:mod:`pace_core.results`), keyed by the checkpoint's content stamp: the bytes of its ``config.json`` and,
for every weights file, its name, size and its first and last :data:`STAMP_EDGE_BYTES` bytes. Any change
of the config or of a weights file's size, header, first or last values gives another stamp, so a
stale card is never shown; the values in between do not count, as for
:func:`pace_core.model.loading.weights_fingerprint`. Reading a card imports neither torch nor
transformers. A hub id has no local folder to stamp and gets no card: it is loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Any

from pace_core.errors import PaceError
from pace_core.shapes import ModelShape

CARD_KIND = "model_card"
CARD_VERSION = 1  # part of the key: a card of another layout is never read
STAMP_EDGE_BYTES = 1 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
LOAD_ONLY_FIELDS = ("dtype", "device")
"""Fields of ``LoadedModel.summary()`` that belong to one load, not to the checkpoint: not in a card."""


@dataclasses.dataclass(frozen=True)
class ModelCard:
    """What a load of ``source`` measured: ``shape``, ``summary`` (``LoadedModel.summary()`` without
    :data:`LOAD_ONLY_FIELDS`) and the weights ``fingerprint``."""

    source: str
    shape: ModelShape
    summary: dict[str, Any]
    fingerprint: str


def checkpoint_stamp(source: str | os.PathLike) -> str | None:
    """16 hex digits over ``config.json`` and every weights file's name, size and edges, or None where
    ``source`` is not a local checkpoint folder (a hub id) or cannot be read."""
    folder = Path(source).expanduser()
    h = hashlib.sha256()
    try:
        h.update((folder / "config.json").read_bytes())
        weights = sorted(p for p in folder.iterdir() if p.name.endswith(WEIGHT_SUFFIXES) and p.is_file())
        for path in weights:
            size = path.stat().st_size
            h.update(f"{path.name}:{size};".encode())
            with open(path, "rb") as f:
                h.update(f.read(STAMP_EDGE_BYTES))
                f.seek(max(size - STAMP_EDGE_BYTES, 0))
                h.update(f.read(STAMP_EDGE_BYTES))
    except OSError:
        return None
    return h.hexdigest()[:16]


def card_of(loaded: Any) -> ModelCard:
    """The card of a :class:`pace_core.model.loading.LoadedModel`."""
    summary = {k: v for k, v in loaded.summary().items() if k not in LOAD_ONLY_FIELDS}
    return ModelCard(loaded.source, loaded.shape, summary, loaded.fingerprint)


def _key(stamp: str) -> str:
    from pace_core.results import result_key

    return result_key({"kind": CARD_KIND, "version": CARD_VERSION, "stamp": stamp})


def save_card(card: ModelCard, model: str, *, root: str | os.PathLike | None = None) -> bool:
    """Store ``card`` for the results name ``model`` unless a card of the same stamp is stored; False (and
    nothing written) for a hub id or a read-only results folder: the card only spares a later load."""
    from pace_core.results import load_result, make_provenance, save_result

    stamp = checkpoint_stamp(card.source)
    if stamp is None:
        return False
    key = _key(stamp)
    if load_result(CARD_KIND, model, key, root=root) is not None:
        return True
    data = {"source": card.source, "shape": dataclasses.asdict(card.shape), "summary": card.summary,
            "fingerprint": card.fingerprint}
    try:
        save_result(CARD_KIND, model, key, data, make_provenance(model, extra={"weights": card.fingerprint}), root=root)
    except OSError:
        return False
    return True


def load_card(source: str | os.PathLike, model: str, *, root: str | os.PathLike | None = None) -> ModelCard | None:
    """The stored card of the checkpoint folder ``source`` (results name ``model``) whose stamp matches
    the folder as it is now, or None (no folder, no card, a damaged card). The card names ``source``
    where it named the folder it was made from (a clone of the repository elsewhere, a moved folder)."""
    from pace_core.results import load_result

    stamp = checkpoint_stamp(source)
    found = None if stamp is None else load_result(CARD_KIND, model, _key(stamp), root=root)
    if found is None:
        return None
    data, here = found.data, str(source)
    try:
        made_from, fields, summary = str(data["source"]), dict(data["shape"]), dict(data["summary"])
        if fields.get("gdn_layers") is not None:
            fields["gdn_layers"] = tuple(fields["gdn_layers"])
        if fields.get("name") == made_from:
            fields["name"] = here
        if summary.get("source") == made_from:
            summary["source"] = here
        return ModelCard(here, ModelShape(**fields), summary, str(data["fingerprint"]))
    except (KeyError, TypeError, ValueError, PaceError):
        return None
