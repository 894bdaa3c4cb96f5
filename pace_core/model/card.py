"""A checkpoint's card: what the Overview and Memory pages show of a model (its state geometry, its
architecture summary and its weights fingerprint) without loading it.

Loading a model means importing transformers' model code and reading every weight (seconds on a CPU,
minutes for a large checkpoint), yet these pages need only numbers a load has measured once. So every
load through ``python -m pace_core`` or the app stores a card in the results cache (kind ``model_card``,
:mod:`pace_core.results`), keyed by the load's dtype (the fingerprint reads the loaded values) and the
checkpoint's content stamp: the bytes of its ``config.json`` and, for every safetensors file, its header
(each tensor's name, dtype, shape and place) and each tensor's first and last
:data:`STAMP_EDGE_VALUES` values. That is the resolution of
:func:`pace_core.model.loading.weights_fingerprint` (each parameter's first and last values), at the
tensors as stored: an edit that moves none of them is not seen by either. A folder with weights in
another format (``.bin``, ``.pt``), or a hub id, has no stamp and gets no card: it is loaded. Reading a
card imports neither torch nor transformers. A change of :class:`ModelCard`'s fields or of
``LoadedModel.summary()`` needs a new :data:`CARD_VERSION` (the shipped card's test fails until then).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

from pace_core.errors import PaceError
from pace_core.model import DEFAULT_MODEL_DIR
from pace_core.results import DamagedResult, load_result, make_provenance, result_key, save_result
from pace_core.shapes import ModelShape

CARD_KIND = "model_card"
CARD_VERSION = 2  # part of the key: a card of another layout is never read
STAMP_EDGE_VALUES = 64  # as pace_core.model.loading.FINGERPRINT_VALUES
OTHER_WEIGHTS = (".bin", ".pt", ".pth")
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                     "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
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


def _stamp_safetensors(path: Path, h) -> None:
    """Add a safetensors file's header and each tensor's first and last values to the hash ``h``."""
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = f.read(size)
        h.update(header)
        for name, info in sorted(json.loads(header).items()):
            if name == "__metadata__":
                continue
            begin, stop = info["data_offsets"]
            edge = STAMP_EDGE_VALUES * SAFETENSORS_BYTES.get(info["dtype"], 8)
            for at in sorted({begin, max(begin, stop - edge)}):
                f.seek(8 + size + at)
                h.update(f.read(min(edge, stop - at)))


def checkpoint_stamp(source: str | os.PathLike | None) -> str | None:
    """16 hex digits over ``config.json`` and every safetensors file's header and tensor edges, or None
    where ``source`` is not a local checkpoint folder of safetensors files (a hub id, ``.bin`` weights)
    or cannot be read. ``source`` None is the embedded model, as for ``load_model``."""
    folder = Path(source if source is not None else DEFAULT_MODEL_DIR).expanduser()
    h = hashlib.sha256()
    try:
        h.update((folder / "config.json").read_bytes())
        files = sorted(p for p in folder.iterdir() if p.is_file())
        if any(p.name.endswith(OTHER_WEIGHTS) for p in files):
            return None
        weights = [p for p in files if p.name.endswith(".safetensors")]
        for path in weights:
            h.update(f"{path.name};".encode())
            _stamp_safetensors(path, h)
    except (OSError, ValueError, KeyError, TypeError, struct.error):  # unreadable, or not a safetensors file
        return None
    return h.hexdigest()[:16] if weights else None


def card_of(loaded: Any) -> ModelCard:
    """The card of a :class:`pace_core.model.loading.LoadedModel`."""
    summary = {k: v for k, v in loaded.summary().items() if k not in LOAD_ONLY_FIELDS}
    return ModelCard(loaded.source, loaded.shape, summary, loaded.fingerprint)


def _key(stamp: str, dtype: str) -> str:
    """The card's result key. No method version in it: a card holds the checkpoint's shape and fingerprint,
    which the method's numerics do not change (CARD_VERSION covers the card's own form)."""
    return result_key({"kind": CARD_KIND, "version": CARD_VERSION, "stamp": stamp, "dtype": dtype})


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def save_card(loaded: Any, model: str, before: str | None, *, root: str | os.PathLike | None = None) -> bool:
    """Store the card of the :class:`~pace_core.model.loading.LoadedModel` ``loaded`` for the results name
    ``model``, under ``before``, its folder's stamp taken before the load. Nothing is stored (False) for a
    hub id, a folder that changed during the load, a load with offloaded (``meta``) weights (the fingerprint
    counts those by name only) or an unwritable results folder: the card only spares a later load. A card
    of the same stamp and dtype is kept as it is."""
    if before is None or checkpoint_stamp(loaded.source) != before or any(
            p.device.type == "meta" for p in loaded.model.parameters()):
        return False
    key = _key(before, _dtype_name(loaded.dtype))
    try:
        try:
            stored = load_result(CARD_KIND, model, key, root=root)
        except DamagedResult:  # replaced by this load's card
            stored = None
        if stored is None:
            card = card_of(loaded)
            data = {"source": card.source, "shape": dataclasses.asdict(card.shape), "summary": card.summary,
                    "fingerprint": card.fingerprint}
            provenance = make_provenance(loaded.reference, extra={"weights": card.fingerprint})
            save_result(CARD_KIND, model, key, data, provenance, root=root)
    except (OSError, PaceError):  # a results folder that cannot be written or named
        return False
    return True


def load_card(source: str | os.PathLike, model: str, dtype: str, *,
              root: str | os.PathLike | None = None) -> ModelCard | None:
    """The card stored for the checkpoint folder ``source`` (results name ``model``) as it is now, by a load
    in ``dtype`` (e.g. ``float32``), or None (no folder, no card, a damaged card: the caller loads the model,
    whose load stores the card again). The card names ``source``
    where it named the folder it was made from (a clone of the repository elsewhere, a moved folder)."""
    stamp = checkpoint_stamp(source)
    try:
        found = None if stamp is None else load_result(CARD_KIND, model, _key(stamp, _dtype_name(dtype)), root=root)
    except DamagedResult:
        return None
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
