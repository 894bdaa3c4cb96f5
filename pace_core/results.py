"""Results cache: analysis outputs stored atomically under ``data/results/<model>/``.

Every result is one JSON file ``<kind>-<key>.json`` (the data and its provenance) plus, when the
result has a table, one Parquet file ``<kind>-<key>.parquet``. Each file is written to a temporary
file in the same folder and moved into place with ``os.replace``, so a reader sees either the old
file or the new one, never a partial write. The Parquet file is written first and the JSON last: the
JSON is the commit marker, and ``load_result`` only returns a result whose JSON exists.

The key is a short hash of the parameters that define the result (model, its weights' fingerprint,
configurations, text hash, token counts, ...), so the app and a later run of the CLI find the same result again.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import re
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from pace_core.errors import PaceError

SCHEMA_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RESULTS_ROOT = REPO_ROOT / "data" / "results"
RESULTS_ENV = "PACE_RESULTS_DIR"
_KIND_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_KEY_RE = re.compile(r"^[0-9a-f]{16}$")


@dataclass
class Result:
    """One cached analysis result.

    ``data`` is JSON-serialisable; ``table`` (optional) is the long-form table the figures use.
    """

    kind: str
    model: str
    key: str
    data: dict[str, Any]
    provenance: dict[str, Any]
    table: pd.DataFrame | None = field(default=None, compare=False)
    path: Path | None = field(default=None, compare=False)


def results_root(root: str | os.PathLike | None = None) -> Path:
    """The folder holding one sub-folder per model: ``root``, else $PACE_RESULTS_DIR, else data/results."""
    if root is not None:
        return Path(root)
    env = os.environ.get(RESULTS_ENV)
    return Path(env) if env else DEFAULT_RESULTS_ROOT


def model_folder_name(model: str) -> str:
    """File-system name of a model: a hub id ``Qwen/Qwen3.5-4B`` -> ``Qwen--Qwen3.5-4B``;
    a local checkpoint folder -> its folder name."""
    if not model or not model.strip():
        raise PaceError("model: must be a non-empty path or hub id")
    text = model.strip()
    if os.path.isdir(text):
        text = Path(text).resolve().name
    name = text.strip("/").replace("/", "--")
    name = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    if name in {"", ".", ".."}:
        raise PaceError(f"model: {model!r} gives no usable folder name")
    return name


def results_dir(model: str, root: str | os.PathLike | None = None) -> Path:
    """``<results root>/<model folder name>``."""
    return results_root(root) / model_folder_name(model)


def canonical_json(obj: Any) -> str:
    """Deterministic JSON (sorted keys, no spaces) used for hashing."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=_json_default)


def result_key(params: dict[str, Any]) -> str:
    """16 hex digits of sha256 over the canonical JSON of ``params``."""
    return hashlib.sha256(canonical_json(params).encode("utf-8")).hexdigest()[:16]


def config_hash(cfg: Any) -> str:
    """sha256 (16 hex digits) of a PaceConfig's canonical JSON form."""
    from pace_core.config import config_to_dict

    return result_key(config_to_dict(cfg))


def text_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def versions() -> dict[str, str]:
    """Versions of pace_core, torch, transformers and Python."""
    import torch
    import transformers

    import pace_core

    return {
        "pace_core": getattr(pace_core, "__version__", "unknown"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def make_provenance(
    model: str,
    *,
    configs: list[Any] = (),
    text_path: str | os.PathLike | None = None,
    command: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Provenance block: model, config hashes, versions, text path + sha256, UTC date, command."""
    prov: dict[str, Any] = {
        "model": model,
        "config_hashes": {getattr(c, "name", str(i)): config_hash(c) for i, c in enumerate(configs)},
        "versions": versions(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command if command is not None else " ".join(sys.argv),
    }
    if text_path is not None:
        prov["text"] = {"path": str(text_path), "sha256": text_sha256(text_path)}
    if extra:
        prov.update(extra)
    return prov


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, (Path, os.PathLike)):
        return str(o)
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _check_kind_key(kind: str, key: str) -> None:
    if not _KIND_RE.match(kind or ""):
        raise PaceError(f"kind: {kind!r} must be lower-case letters, digits and '_' (e.g. 'drift')")
    if not _KEY_RE.match(key or ""):
        raise PaceError(f"key: {key!r} must be 16 lower-case hex digits (from result_key)")


def atomic_write(path: Path, write) -> None:
    """Write through ``write(tmp_path)`` to a temp file in ``path``'s folder, then os.replace. The temp
    file is created as a plain file is (mode 0o666 less the umask; ``mkstemp`` would make it private)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp")
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_result(
    kind: str,
    model: str,
    key: str,
    data: dict[str, Any],
    provenance: dict[str, Any],
    table: pd.DataFrame | None = None,
    *,
    root: str | os.PathLike | None = None,
) -> Result:
    """Store a result atomically (Parquet table first, then the JSON marker) and return it."""
    _check_kind_key(kind, key)
    folder = results_dir(model, root)
    base = folder / f"{kind}-{key}"
    if table is not None:
        atomic_write(base.with_suffix(".parquet"), lambda p: table.to_parquet(p, index=False))
    doc = {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "model": model,
        "key": key,
        "has_table": table is not None,
        "provenance": provenance,
        "data": data,
    }
    text = json.dumps(doc, indent=1, default=_json_default, allow_nan=True)
    atomic_write(base.with_suffix(".json"), lambda p: p.write_text(text, encoding="utf-8"))
    return Result(kind, model, key, json.loads(text)["data"], provenance, table, base.with_suffix(".json"))


def load_result(kind: str, model: str, key: str, *, root: str | os.PathLike | None = None) -> Result | None:
    """The stored result of ``kind`` for ``model`` under ``key``, or None if absent or unreadable (not
    UTF-8 JSON of a result object, a field missing, a damaged or unreadable Parquet table)."""
    _check_kind_key(kind, key)
    base = results_dir(model, root) / f"{kind}-{key}"
    path = base.with_suffix(".json")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # ValueError: not UTF-8 or not JSON
        return None
    if (not isinstance(doc, dict) or doc.get("schema_version") != SCHEMA_VERSION or doc.get("kind") != kind
            or doc.get("key") != key or not isinstance(doc.get("model"), str)
            or not isinstance(doc.get("data"), dict) or not isinstance(doc.get("provenance"), dict)):
        return None
    table = None
    if doc.get("has_table"):
        try:
            table = pd.read_parquet(base.with_suffix(".parquet"))
        except (OSError, ValueError):  # missing, unreadable or damaged (pyarrow's ArrowInvalid is a ValueError)
            return None
    return Result(kind, doc["model"], key, doc["data"], doc["provenance"], table, path)


def list_results(model: str, kind: str | None = None, *, root: str | os.PathLike | None = None) -> list[Result]:
    """All stored results of a model (optionally of one kind), newest first."""
    folder = results_dir(model, root)
    if not folder.is_dir():
        return []
    out = []
    for p in folder.glob("*.json"):
        stem = p.stem
        k, _, key = stem.rpartition("-")
        if (kind is None or k == kind) and _KIND_RE.match(k) and _KEY_RE.match(key):
            r = load_result(k, model, key, root=root)
            if r is not None:
                out.append(r)
    out.sort(key=lambda r: r.provenance.get("date", ""), reverse=True)
    return out


@dataclass
class ResultSet:
    """Results stored one per configuration for one setting (the same ``params_key``): what a command run
    on several configurations leaves, possibly over several runs. ``results`` are in the order of the named
    configurations (fp32 first), then the others by name, whatever order the runs stored them in."""

    kind: str
    params_key: str
    results: list[Result]

    @property
    def configs(self) -> list[str]:
        """The configurations' names."""
        return [r.data.get("config", "?") for r in self.results]

    @property
    def provenance(self) -> dict[str, Any]:
        """The newest result's provenance."""
        return max(self.results, key=lambda r: r.provenance.get("date", "")).provenance

    @property
    def table(self) -> pd.DataFrame:
        """The results' tables one after the other, or, where a result has none, its ``data["row"]``."""
        parts = [r.table if r.table is not None else pd.DataFrame([r.data["row"]]) for r in self.results]
        return pd.concat(parts, ignore_index=True)

    def rows(self, field: str) -> list[Any]:
        """``data[field]`` of every result."""
        return [r.data[field] for r in self.results]


def _config_order(result: Result) -> tuple[int, str]:
    from pace_core.config import NAMED_CONFIGS

    names = list(NAMED_CONFIGS)
    name = result.data.get("config", "")
    return (names.index(name) if name in names else len(names), name)


def result_sets(model: str, kind: str, *, root: str | os.PathLike | None = None,
                weights: str | None = None) -> list[ResultSet]:
    """The stored per-configuration results of ``kind`` (those written with a ``params_key``; of the weights
    ``weights`` when given) grouped into one :class:`ResultSet` per setting, newest set first."""
    sets: dict[str, list[Result]] = {}
    for r in list_results(model, kind, root=root):
        if "params_key" in r.data and (weights is None or r.provenance.get("weights") == weights):
            sets.setdefault(r.data["params_key"], []).append(r)
    out = []
    for key, results in sets.items():
        results.sort(key=_config_order)
        out.append(ResultSet(kind, key, results))
    out.sort(key=lambda s: s.provenance.get("date", ""), reverse=True)
    return out
