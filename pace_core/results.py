"""Results cache: analysis outputs stored under ``data/results/<model>/``, published atomically.

Layout of one result of kind ``<kind>`` under key ``<key>`` (16 hex digits):

- ``<kind>-<key>.json``: the result (indented JSON): ``schema_version`` (2), ``kind``, ``model``, ``key``,
  ``provenance`` (model, weights fingerprint, configuration hashes, library versions, text path and
  sha256, date, command, ``method_version`` and ``code``: the git commit, see :mod:`pace_core.version`),
  ``data`` (the numbers the pages and the CLI print) and ``table``: null, or ``{"file", "sha256"}`` naming
  its long-form table;
- ``<kind>-<key>.<sha8>.parquet``: that table, under a name made of the first 8 hex digits of its
  content's sha256, so a new table never replaces the one an older JSON names.

Publication: the table is written first (a temporary file, fsynced, moved into place with ``os.replace``,
the folder fsynced), then the JSON the same way: the JSON is the commit marker, and a reader sees
either the old pair or the new one, never a mixed one. A reader reads the JSON, then exactly the table
it names, and checks the table's sha256; if that table was removed meanwhile (a newer pair was
published and the old table cleaned) it reads the JSON again. Tables no JSON names and temporary files
left by a killed writer are removed by the next save or listing (:func:`clean_results`): a temporary
file at once when the process that wrote it is gone, otherwise either kind once it is
:data:`ORPHAN_GRACE_S` old, so that a writer between its table and its JSON never loses its table.
Results of schema 1 (before this layout: the table ``<kind>-<key>.parquet``, no hash) are still read.

Every result read is checked (:func:`pace_core.result_checks.check_result`: the fields its pages need,
and sanity bounds per kind, e.g. a small state error of an unquantised configuration); a file that
cannot be read or fails a check is reported as :class:`Damaged` (path and reason), never dropped
silently. A result whose ``method_version`` is not :data:`pace_core.version.METHOD_VERSION` is stale
(:attr:`Result.stale`): the CLI keys hold the method version, so it computes a new one, and the app
labels the old one stale.

The key is a short hash of the parameters that define the result (model, its weights' fingerprint,
configurations, text hash, token counts, method version, ...), so the app and a later run of the CLI
find the same result again.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from pace_core.config import NAMED_CONFIGS
from pace_core.errors import PaceError
from pace_core.export import config_to_dict
from pace_core.provenance import code_label, invocation, utc_date, versions
from pace_core.result_checks import check_result
from pace_core.version import METHOD_VERSION, REPO_ROOT, code_commit

SCHEMA_VERSION = 2
LEGACY_SCHEMA_VERSION = 1
"""Schema 1: the table in ``<kind>-<key>.parquet`` (``has_table``), no hash; read, never written."""
DEFAULT_RESULTS_ROOT = REPO_ROOT / "data" / "results"
RESULTS_ENV = "PACE_RESULTS_DIR"
ORPHAN_GRACE_S = 600.0
"""Age (seconds since last change) after which a table no JSON names, or a temporary file of a process that
may still run, is removed. Far above the time between a writer's table and its JSON (milliseconds)."""
_KIND_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_KEY_RE = re.compile(r"^[0-9a-f]{16}$")
_JSON_RE = re.compile(r"^(?P<kind>[a-z][a-z0-9_]*)-(?P<key>[0-9a-f]{16})\.json$")
_TABLE_RE = re.compile(r"^(?P<stem>[a-z][a-z0-9_]*-[0-9a-f]{16})(?:\.(?P<sha8>[0-9a-f]{8}))?\.parquet$")
_TMP_RE = re.compile(r"^\..+\.(?P<host>[0-9a-f]{8})\.(?P<pid>[0-9]+)\.[0-9a-f]{32}\.tmp$")
_HOST = hashlib.sha256(socket.gethostname().encode("utf-8")).hexdigest()[:8]
_READ_ATTEMPTS = 4


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

    @property
    def method_version(self) -> int | None:
        """The method version of the code that made it (None: made before versions were recorded)."""
        return self.provenance.get("method_version")

    @property
    def stale(self) -> bool:
        """True when another method version (or none recorded) made it: not a current result."""
        return self.method_version != METHOD_VERSION

    @property
    def stale_label(self) -> str | None:
        """None for a current result, else ``stale: made by method version N (code <commit>), recompute
        with `<command>```."""
        return stale_label(self.provenance) if self.stale else None


def stale_label(provenance: dict[str, Any]) -> str:
    """What made a result of another method version and how to recompute it (its own command: the key of a
    new run holds the current method version, so the command computes instead of reusing)."""
    version = provenance.get("method_version")
    made = "before method versions were recorded" if version is None else f"by method version {version}"
    return (f"stale: made {made} (code {code_label(provenance)}; the current method version is {METHOD_VERSION}), "
            f"recompute with `{provenance.get('command') or 'python -m pace_core <command>'}`")


@dataclass(frozen=True)
class Damaged:
    """A stored result file that cannot be used: its path, why, and the command that made it (when the
    file still says)."""

    path: Path
    reason: str
    command: str | None = None

    @property
    def message(self) -> str:
        """One line for the app and the CLI: the file, what is wrong, and what to do."""
        redo = f"`{self.command}`" if self.command else "the `python -m pace_core` command that made it"
        return f"{self.path}: {self.reason}. Delete it, or recompute it with {redo}."


class DamagedResult(PaceError):
    """A stored result that cannot be read or fails its checks (:attr:`damaged`)."""

    def __init__(self, damaged: Damaged):
        super().__init__(f"damaged stored result {damaged.message}")
        self.damaged = damaged


@dataclass
class Listing:
    """What a folder holds: the readable results (or :class:`ResultSet` s, from :func:`result_sets`) and the
    :class:`Damaged` files beside them."""

    results: list[Any]
    damaged: list[Damaged]


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
    return result_key(config_to_dict(cfg))


def text_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def make_provenance(
    model: str,
    *,
    configs: list[Any] = (),
    text_path: str | os.PathLike | None = None,
    command: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Provenance block: model, config hashes, versions, the method version and the code's git commit
    (:mod:`pace_core.version`; ``code`` is None outside a git checkout), text path + sha256, UTC date,
    command (:mod:`pace_core.provenance`: what made a number, in one place)."""
    prov: dict[str, Any] = {
        "model": model,
        "config_hashes": {getattr(c, "name", str(i)): config_hash(c) for i, c in enumerate(configs)},
        "versions": versions(),
        "method_version": METHOD_VERSION,
        "code": code_commit(),
        "date": utc_date(),
        "command": command if command is not None else invocation(),
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


def atomic_write(path: Path, write: Callable[[Path], Any]) -> None:
    """Write through ``write(tmp_path)`` to a temporary file in ``path``'s folder, fsync it, move it into
    place with ``os.replace`` and fsync the folder: after a crash ``path`` is the old file or the whole new
    one. The temporary file (``.<name>.<host>.<pid>.<random>.tmp``: :func:`clean_results` knows its writer)
    is created as a plain file is (mode 0o666 less the umask; ``mkstemp`` would make it private)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(path.parent / f".{path.name}.{_HOST}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    try:
        write(Path(tmp))
        fd = os.open(tmp, os.O_RDWR)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    """fsync a folder, so that a rename in it survives a crash (where the system can open folders)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. Windows: folders cannot be opened; its renames are durable on their own
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    """Check and publish a result (module docstring: its table under a content-addressed name, then the
    JSON naming it) and return it. A result that fails its checks (:mod:`pace_core.result_checks`) is
    refused with PaceError and nothing is written. Afterwards the folder's orphans are cleaned. ``model`` names the
    folder; the file names the model as its provenance does (as another machine finds it), else as ``model``."""
    _check_kind_key(kind, key)
    folder = results_dir(model, root)
    path = folder / f"{kind}-{key}.json"
    data = json.loads(json.dumps(data, default=_json_default, allow_nan=True))  # as a reader will see it
    result = Result(kind, provenance.get("model") or model, key, data, provenance, table, path)
    try:
        check_result(result)
    except PaceError as err:
        raise PaceError(f"{kind} result not stored: {err}") from None
    blob, ref = None, None
    if table is not None:
        buf = io.BytesIO()
        table.to_parquet(buf, index=False)
        blob = buf.getvalue()
        sha = hashlib.sha256(blob).hexdigest()
        ref = {"file": f"{kind}-{key}.{sha[:8]}.parquet", "sha256": sha}
        atomic_write(folder / ref["file"], lambda p: p.write_bytes(blob))
    doc = {"schema_version": SCHEMA_VERSION, "kind": kind, "model": result.model, "key": key, "table": ref,
           "provenance": provenance, "data": data}
    text = json.dumps(doc, indent=1, default=_json_default, allow_nan=True)
    atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))
    if ref is not None and not (folder / ref["file"]).exists():  # a concurrent clean took it between the two
        atomic_write(folder / ref["file"], lambda p: p.write_bytes(blob))
    clean_results(folder)
    return result


def load_result(kind: str, model: str, key: str, *, root: str | os.PathLike | None = None) -> Result | None:
    """The stored result of ``kind`` for ``model`` under ``key``, or None if there is none. A file that cannot
    be read (not UTF-8 JSON of a result object, a field missing, its table missing, damaged or not the
    one its JSON names) or that fails its checks raises :class:`DamagedResult` naming it and the reason."""
    _check_kind_key(kind, key)
    folder = results_dir(model, root)
    path = folder / f"{kind}-{key}.json"
    command = None
    for attempt in range(_READ_ATTEMPTS):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, RecursionError) as err:  # ValueError: not UTF-8 or not JSON
            raise DamagedResult(Damaged(path, f"not a readable JSON result ({type(err).__name__}: {err})")) from None
        if isinstance(doc, dict) and isinstance(doc.get("provenance"), dict):
            command = doc["provenance"].get("command")
        try:
            name = _table_name(doc, kind, key)
        except PaceError as err:
            raise DamagedResult(Damaged(path, str(err), command)) from None
        table = None
        if name is not None:
            try:
                blob = (folder / name).read_bytes()
            except FileNotFoundError:  # a newer pair replaced this one and its table was cleaned: read again
                if attempt + 1 < _READ_ATTEMPTS:
                    time.sleep(0.01 * (attempt + 1))
                    continue
                raise DamagedResult(Damaged(path, f"the table it names, {name}, is missing", command)) from None
            except OSError as err:
                raise DamagedResult(Damaged(path, f"its table {name} cannot be read ({err})", command)) from None
            sha = doc["table"]["sha256"] if doc["schema_version"] == SCHEMA_VERSION else None
            if sha is not None and hashlib.sha256(blob).hexdigest() != sha:
                raise DamagedResult(Damaged(path, f"its table {name} is not the one it names (sha256 differs)",
                                            command))
            try:
                table = pd.read_parquet(io.BytesIO(blob))
            except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
                raise DamagedResult(Damaged(path, f"its table {name} is not a readable Parquet file ({err})",
                                            command)) from None
        result = Result(kind, doc["model"], key, doc["data"], doc["provenance"], table, path)
        try:
            check_result(result)
        except PaceError as err:
            raise DamagedResult(Damaged(path, f"refused by its sanity check: {err}", command)) from None
        return result
    raise AssertionError("unreachable")  # the last attempt returns or raises


def _table_name(doc: Any, kind: str, key: str) -> str | None:
    """The file name of the table a result document names (None: no table); PaceError naming what is
    malformed."""
    if not isinstance(doc, dict) or doc.get("schema_version") not in (SCHEMA_VERSION, LEGACY_SCHEMA_VERSION):
        raise PaceError(f"not a result document of schema {SCHEMA_VERSION} or {LEGACY_SCHEMA_VERSION}")
    if doc.get("kind") != kind or doc.get("key") != key:
        raise PaceError(f"its kind or key ({doc.get('kind')!r}, {doc.get('key')!r}) is not its name's")
    for name, typ in (("model", str), ("data", dict), ("provenance", dict)):
        if not isinstance(doc.get(name), typ):
            raise PaceError(f"its field {name!r} is missing or not a{'n object' if typ is dict else ' string'}")
    if doc["schema_version"] == LEGACY_SCHEMA_VERSION:
        return f"{kind}-{key}.parquet" if doc.get("has_table") else None
    ref = doc.get("table", False)
    if ref is None:
        return None
    sha = ref.get("sha256") if isinstance(ref, dict) else None
    if not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)
            and ref.get("file") == f"{kind}-{key}.{sha[:8]}.parquet"):
        raise PaceError("its field 'table' is not null or {file: <kind>-<key>.<sha8>.parquet, sha256}")
    return ref["file"]


def list_results(model: str, kind: str | None = None, *, root: str | os.PathLike | None = None) -> Listing:
    """All stored results of a model (optionally of one kind): current ones first, then stale ones, each
    newest first; and the damaged files (:class:`Damaged`) beside them. Orphans are cleaned afterwards."""
    folder = results_dir(model, root)
    if not folder.is_dir():
        return Listing([], [])
    results, damaged = [], []
    for p in sorted(folder.iterdir()):
        m = _JSON_RE.match(p.name)
        if m and (kind is None or m["kind"] == kind):
            try:
                r = load_result(m["kind"], model, m["key"], root=root)
            except DamagedResult as err:
                damaged.append(err.damaged)
                continue
            if r is not None:
                results.append(r)
    results.sort(key=lambda r: r.provenance.get("date", ""), reverse=True)
    results.sort(key=lambda r: r.stale)
    clean_results(folder)
    return Listing(results, damaged)


def clean_results(folder: Path, *, grace_s: float | None = None) -> list[Path]:
    """Remove a results folder's orphans and return them: temporary files of a writer process of this host
    that is gone, and, once older than ``grace_s`` (default :data:`ORPHAN_GRACE_S`), any other temporary
    file and every table no result JSON names (a table beside a JSON that cannot be read is kept).
    Files that cannot be removed (a read-only folder) are left."""
    grace = ORPHAN_GRACE_S if grace_s is None else grace_s
    now, kept, protected, candidates = time.time(), set(), set(), []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    for entry in entries:
        m = _JSON_RE.match(entry.name)
        if m:
            try:
                name = _table_name(json.loads(Path(entry.path).read_text(encoding="utf-8")), m["kind"], m["key"])
            except (OSError, ValueError, RecursionError, PaceError):
                protected.add(entry.name[:-len(".json")])
                continue
            if name is not None:
                kept.add(name)
        elif _TABLE_RE.match(entry.name) or _TMP_RE.match(entry.name):
            candidates.append(entry)
    removed = []
    for entry in candidates:
        try:
            age = now - entry.stat().st_mtime
        except OSError:
            continue
        tmp = _TMP_RE.match(entry.name)
        if tmp:
            gone = tmp["host"] == _HOST and not _process_alive(int(tmp["pid"]))
            if not (gone or age > grace):
                continue
        elif entry.name in kept or _TABLE_RE.match(entry.name)["stem"] in protected or age <= grace:
            continue
        try:
            os.unlink(entry.path)
        except OSError:
            continue
        removed.append(Path(entry.path))
    return removed


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists (another user's: PermissionError), or signals are not available
        return True
    return True


@dataclass
class ResultSet:
    """Results stored one per configuration for one setting (the same ``params_key``) by one method version:
    what a command run on several configurations leaves, possibly over several runs. ``results`` are in
    the order of the named configurations (fp32 first), then the others by name, whatever order the runs
    stored them in."""

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
    def stale(self) -> bool:
        """True when another method version made them (all results of a set share one)."""
        return self.results[0].stale

    @property
    def stale_label(self) -> str | None:
        """As :attr:`Result.stale_label`, of the newest result."""
        return stale_label(self.provenance) if self.stale else None

    @property
    def table(self) -> pd.DataFrame:
        """One part per result, one after the other: its ``data["row"]`` where it has one (a perplexity result,
        whose table holds its per-window sums), else its table."""
        parts = [pd.DataFrame([r.data["row"]]) if "row" in r.data else r.table for r in self.results]
        return pd.concat(parts, ignore_index=True)

    def rows(self, field: str) -> list[Any]:
        """``data[field]`` of every result."""
        return [r.data[field] for r in self.results]


def _config_order(result: Result) -> tuple[int, str]:
    names = list(NAMED_CONFIGS)
    name = result.data.get("config", "")
    return (names.index(name) if name in names else len(names), name)


def result_sets(model: str, kind: str, *, root: str | os.PathLike | None = None,
                weights: str | None = None) -> Listing:
    """The stored per-configuration results of ``kind`` (those written with a ``params_key``; of the weights
    ``weights`` when given) grouped into one :class:`ResultSet` per setting and method version, current
    sets first, each newest first; with the damaged files of ``kind``."""
    listing = list_results(model, kind, root=root)
    sets: dict[tuple[str, Any], list[Result]] = {}
    for r in listing.results:
        if "params_key" in r.data and (weights is None or r.provenance.get("weights") == weights):
            sets.setdefault((r.data["params_key"], r.method_version), []).append(r)
    out = []
    for (key, _), results in sets.items():
        results.sort(key=_config_order)
        out.append(ResultSet(kind, key, results))
    out.sort(key=lambda s: s.provenance.get("date", ""), reverse=True)
    out.sort(key=lambda s: s.stale)
    return Listing(out, listing.damaged)
