import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pace_core import results as R
from pace_core.errors import PaceError
from pace_core.version import METHOD_VERSION

REPO = Path(__file__).resolve().parents[1]
KIND = "probe"  # a kind without checks of its own (pace_core.result_checks): the storage alone


def _table(rng: np.random.Generator, n: int, rows: int | None = None) -> pd.DataFrame:
    rows = int(rng.integers(1, 50)) if rows is None else rows
    return pd.DataFrame({"n": [n] * rows, "x": rng.random(rows)})


def _prov(**extra) -> dict:
    return R.make_provenance("m", command="python -m pace_core probe", extra=extra)


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_round_trip_json_and_content_addressed_table(tmp_path):
    rng = np.random.default_rng(1)
    table = pd.DataFrame({"step": np.arange(7), "rel_err": rng.random(7), "config": ["a"] * 7})
    key = R.result_key({"configs": ["a"], "tokens": 7, "x": float(rng.random())})
    data = {"mean": float(table.rel_err.mean()), "vec": np.arange(3)}
    saved = R.save_result(KIND, "Qwen/Qwen3.5-4B", key, data, _prov(), table, root=tmp_path)
    folder = tmp_path / "Qwen--Qwen3.5-4B"
    [parquet] = [p for p in folder.iterdir() if p.suffix == ".parquet"]
    sha = hashlib.sha256(parquet.read_bytes()).hexdigest()
    assert _names(folder) == sorted([f"{KIND}-{key}.json", f"{KIND}-{key}.{sha[:8]}.parquet"])
    text = (folder / f"{KIND}-{key}.json").read_text()
    doc = json.loads(text)
    assert text.startswith("{\n \"schema_version\": 2")  # indented, readable
    assert doc["table"] == {"file": parquet.name, "sha256": sha}
    assert doc["provenance"]["method_version"] == METHOD_VERSION and "commit" in doc["provenance"]["code"]
    got = R.load_result(KIND, "Qwen/Qwen3.5-4B", key, root=tmp_path)
    assert got == saved and not got.stale and got.stale_label is None
    assert got.data == {"mean": data["mean"], "vec": [0, 1, 2]}
    pd.testing.assert_frame_equal(got.table, table)
    assert R.load_result(KIND, "Qwen/Qwen3.5-4B", "0" * 16, root=tmp_path) is None
    assert R.load_result("sweep", "Qwen/Qwen3.5-4B", key, root=tmp_path) is None
    listing = R.list_results("Qwen/Qwen3.5-4B", root=tmp_path)
    assert [r.key for r in listing.results] == [key] and listing.damaged == []


def test_a_new_table_never_replaces_the_one_an_older_json_names(tmp_path):
    """Saving again under the same key publishes the new table beside the old one; the old table is removed
    only once no JSON names it and it is older than the grace period."""
    rng = np.random.default_rng(2)
    key = R.result_key({"k": 1})
    R.save_result(KIND, "m", key, {"n": 1}, _prov(), _table(rng, 1), root=tmp_path)
    [old] = [p for p in (tmp_path / "m").iterdir() if p.suffix == ".parquet"]
    R.save_result(KIND, "m", key, {"n": 2}, _prov(), _table(rng, 2), root=tmp_path)
    tables = [p for p in (tmp_path / "m").iterdir() if p.suffix == ".parquet"]
    assert len(tables) == 2 and old in tables  # young: a reader of the old JSON may still come for it
    stamp = time.time() - R.ORPHAN_GRACE_S - 1
    os.utime(old, (stamp, stamp))
    listing = R.list_results("m", root=tmp_path)
    assert not old.exists() and [r.data["n"] for r in listing.results] == [2]
    assert listing.results[0].table.n.tolist() == [2] * len(listing.results[0].table)


def test_atomic_write_fsyncs_the_file_before_the_replace_and_the_folder_after(tmp_path, monkeypatch):
    events, paths = [], {}
    real_open, real_fsync, real_replace = os.open, os.fsync, os.replace

    def opened(path, flags, *args):
        fd = real_open(path, flags, *args)
        paths[fd] = Path(path)
        return fd

    monkeypatch.setattr(os, "open", opened)
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", paths[fd])), real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", Path(b))), real_replace(a, b)))
    target = tmp_path / "out.json"
    R.atomic_write(target, lambda p: p.write_text("{}"))
    assert [e[0] for e in events] == ["fsync", "replace", "fsync"]
    assert events[0][1].name.startswith(".out.json.") and events[0][1].suffix == ".tmp"  # the written file
    assert events[1][1] == target and events[2][1] == tmp_path  # then the folder holding the new name
    assert target.read_text() == "{}" and _names(tmp_path) == ["out.json"]


def test_a_failed_publication_leaves_the_old_result(tmp_path, monkeypatch):
    rng = np.random.default_rng(3)
    key = R.result_key({"a": 1})
    R.save_result(KIND, "m", key, {"v": 1}, _prov(), _table(rng, 1), root=tmp_path)
    before = _names(tmp_path / "m")

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(RuntimeError):
        R.save_result(KIND, "m", key, {"v": 2}, _prov(), _table(rng, 2), root=tmp_path)
    monkeypatch.undo()
    assert R.load_result(KIND, "m", key, root=tmp_path).data == {"v": 1}
    assert _names(tmp_path / "m") == before  # no temporary file left behind


def test_concurrent_writers_and_readers_never_see_a_mixed_pair(tmp_path):
    """Three writers publish results under one key while two readers read it and list the folder (which
    cleans it): every read is one writer's JSON with exactly that writer's table."""
    key = R.result_key({"race": 1})
    R.save_result(KIND, "m", key, {"n": -1, "rows": 1}, _prov(), _table(np.random.default_rng(0), -1, 1),
                  root=tmp_path)
    stop, reads, errors = threading.Event(), [], []

    def writer(w: int) -> None:
        rng = np.random.default_rng(100 + w)
        try:
            for i in range(25):
                n, rows = 1000 * w + i, int(rng.integers(1, 400))
                R.save_result(KIND, "m", key, {"n": n, "rows": rows}, _prov(), _table(rng, n, rows), root=tmp_path)
        except BaseException as err:
            errors.append(err)

    def reader(r: int) -> None:
        try:
            while not stop.is_set():
                found = (R.load_result(KIND, "m", key, root=tmp_path) if r == 0
                         else R.list_results("m", root=tmp_path).results[0])
                assert set(found.table.n) == {found.data["n"]} and len(found.table) == found.data["rows"], \
                    f"mixed pair: JSON of {found.data}, table of {set(found.table.n)} ({len(found.table)} rows)"
                reads.append(found.data["n"])
        except BaseException as err:
            errors.append(err)

    writers = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    readers = [threading.Thread(target=reader, args=(r,)) for r in range(2)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert not errors, errors[0]
    assert len(reads) > 20 and len(set(reads)) > 3  # the readers saw many different results
    assert R.list_results("m", root=tmp_path).damaged == []


def test_a_reader_whose_table_was_cleaned_reads_the_new_pair(tmp_path, monkeypatch):
    """Between reading a JSON and its table, a writer publishes a new pair and the old table is cleaned:
    the reader reads the JSON again and returns the new pair, not a mixed one nor 'damaged'."""
    rng = np.random.default_rng(4)
    key = R.result_key({"b": 1})
    R.save_result(KIND, "m", key, {"n": 1}, _prov(), _table(rng, 1), root=tmp_path)
    real = Path.read_bytes
    replaced = []

    def read_bytes(self):
        if self.suffix == ".parquet" and not replaced:
            replaced.append(R.save_result(KIND, "m", key, {"n": 2}, _prov(), _table(rng, 2), root=tmp_path))
            R.clean_results(tmp_path / "m", grace_s=0)
            assert not self.exists()  # the table the first JSON named is gone
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    got = R.load_result(KIND, "m", key, root=tmp_path)
    assert replaced and got.data == {"n": 2} and set(got.table.n) == {2}


_KILLED_WRITER = """
import os, sys, time
import numpy as np, pandas as pd
from pace_core import results as R
calls, stop_at = [0], int(sys.argv[2])
real = os.fsync
def fsync(fd):
    calls[0] += 1
    if calls[0] == stop_at:
        print("ready", flush=True)
        time.sleep(120)
    real(fd)
os.fsync = fsync
R.save_result("probe", "m", sys.argv[3], {"n": 2}, {"command": "x"}, pd.DataFrame({"n": [2] * 9}), root=sys.argv[1])
"""


@pytest.mark.parametrize("stop_at", [1, 3], ids=["in the table", "between table and json"])
def test_a_killed_writer_leaves_no_orphan_and_the_old_result(tmp_path, stop_at):
    """A writer killed (SIGKILL) while writing its table's temporary file (fsync 1), or after publishing its
    table while writing its JSON's (fsync 3): the old result is still read, the dead writer's temporary file
    is gone after the next listing, and its unnamed table once it is past the grace period."""
    key = R.result_key({"kill": stop_at})
    R.save_result(KIND, "m", key, {"n": 1}, _prov(), pd.DataFrame({"n": [1] * 5}), root=tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(tmp_path), str(stop_at), key],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout.readline().strip() == "ready"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    folder = tmp_path / "m"
    assert any(p.suffix == ".tmp" for p in folder.iterdir())  # the killed write's leftover
    listing = R.list_results("m", root=tmp_path)
    assert [r.data["n"] for r in listing.results] == [1] and listing.damaged == []
    assert set(listing.results[0].table.n) == {1}
    assert not any(p.suffix == ".tmp" for p in folder.iterdir())  # its writer is gone: removed at once
    tables = [p for p in folder.iterdir() if p.suffix == ".parquet"]
    assert len(tables) == (2 if stop_at == 3 else 1)  # a table published without its JSON waits for the grace
    for p in tables:
        os.utime(p, (time.time() - R.ORPHAN_GRACE_S - 1,) * 2)
    R.save_result(KIND, "m", R.result_key({"other": 1}), {"n": 3}, _prov(), root=tmp_path)
    assert [p.name for p in folder.iterdir() if p.suffix == ".parquet"] == [
        json.loads((folder / f"{KIND}-{key}.json").read_text())["table"]["file"]]
    assert R.load_result(KIND, "m", key, root=tmp_path).data == {"n": 1}


@pytest.mark.parametrize("damage", ["truncated table", "another table", "table missing", "json list", "not utf-8",
                                    "no provenance", "not a json", "fails its check"])
def test_damaged_results_are_reported_by_name(tmp_path, damage):
    """A damaged stored result is listed beside the readable ones with its path and reason (never dropped),
    and load_result raises naming it."""
    rng = np.random.default_rng(5)
    good, bad = R.result_key({"good": 1}), R.result_key({"bad": 1})
    for key in (good, bad):
        R.save_result(KIND, "m", key, {"k": key}, _prov(), _table(rng, 0), root=tmp_path)
    path = tmp_path / "m" / f"{KIND}-{bad}.json"
    doc = json.loads(path.read_text())
    table = tmp_path / "m" / doc["table"]["file"]
    reason = {"truncated table": "not the one it names", "another table": "field 'table'",
              "table missing": "is missing", "json list": "not a result document", "not utf-8": "not a readable JSON",
              "no provenance": "'provenance' is missing", "not a json": "not a readable JSON",
              "fails its check": "refused by its sanity check"}[damage]
    if damage == "truncated table":
        table.write_bytes(table.read_bytes()[:40])
    elif damage == "another table":
        other = json.loads((tmp_path / "m" / f"{KIND}-{good}.json").read_text())["table"]
        path.write_text(json.dumps({**doc, "table": other}))
    elif damage == "table missing":
        table.unlink()
    elif damage == "json list":
        path.write_text("[]")
    elif damage == "not utf-8":
        path.write_bytes(b"\xff\xfe{")
    elif damage == "no provenance":
        del doc["provenance"]
        path.write_text(json.dumps(doc))
    elif damage == "not a json":
        path.write_text("{not json")
    else:  # a perplexity row of the reference with a KL to itself
        kind, row = "perplexity", {"config": "fp32", "tokens": 9, "nll": 2.0, "ppl": float(np.exp(2.0)),
                                   "agreement": 1.0, "kl": 0.0, "bpb": 1.0}
        R.save_result(kind, "m", bad, {"config": "fp32", "row": row, "decode_from": 1}, _prov(), root=tmp_path)
        path.unlink()
        path = tmp_path / "m" / f"{kind}-{bad}.json"
        doc = json.loads(path.read_text())
        doc["data"]["row"]["kl"] = 0.25
        path.write_text(json.dumps(doc))
    listing = R.list_results("m", root=tmp_path)
    assert [r.key for r in listing.results] == [good]
    [damaged] = listing.damaged
    assert damaged.path == path and reason in damaged.reason, damaged.reason
    assert str(path) in damaged.message and "Delete it, or recompute it with" in damaged.message
    with pytest.raises(R.DamagedResult, match=str(path.name)):
        R.load_result(path.stem.split("-")[0], "m", bad, root=tmp_path)
    if damage in ("truncated table", "table missing", "another table"):  # the file still names its command
        assert damaged.command == "python -m pace_core probe"
    assert table.exists() or damage == "table missing"  # a damaged result's table is not cleaned away


def test_a_result_failing_its_check_is_not_stored(tmp_path):
    row = {"config": "fp32", "tokens": 9, "nll": 2.0, "ppl": 3.0, "agreement": 1.0, "kl": 0.0, "bpb": 1.0}
    with pytest.raises(PaceError, match=r"perplexity result not stored: fp32's perplexity 3.0 is not exp\(NLL\)"):
        R.save_result("perplexity", "m", R.result_key({}), {"config": "fp32", "row": row, "decode_from": 1},
                      _prov(), root=tmp_path)
    assert not (tmp_path / "m").exists() or _names(tmp_path / "m") == []


def test_results_of_another_method_version_are_stale(tmp_path):
    rng = np.random.default_rng(6)
    keys = [R.result_key({"v": v}) for v in range(3)]
    old = {k: v for k, v in _prov().items() if k not in ("method_version", "code")}  # before versions existed
    R.save_result(KIND, "m", keys[0], {"params_key": "s", "config": "fp32"}, {**old, "date": "2027"},
                  _table(rng, 0), root=tmp_path)
    R.save_result(KIND, "m", keys[1], {"params_key": "s", "config": "fp32"},
                  {**_prov(), "method_version": METHOD_VERSION - 1, "code": {"commit": "a" * 40, "dirty": True}},
                  _table(rng, 1), root=tmp_path)
    R.save_result(KIND, "m", keys[2], {"params_key": "s", "config": "fp32"}, {**_prov(), "date": "2000"},
                  _table(rng, 2), root=tmp_path)
    listing = R.list_results("m", root=tmp_path)
    assert [r.key for r in listing.results][0] == keys[2]  # the current one first, although the oldest
    before, older = {r.key: r for r in listing.results}[keys[0]], {r.key: r for r in listing.results}[keys[1]]
    assert before.stale and older.stale and not listing.results[0].stale
    assert before.stale_label == ("stale: made before method versions were recorded (code unknown; the current "
                                  f"method version is {METHOD_VERSION}), recompute with `python -m pace_core probe`")
    assert older.stale_label.startswith(f"stale: made by method version {METHOD_VERSION - 1} (code aaaaaaaaaaaa "
                                        "with uncommitted changes;")
    sets = R.result_sets("m", KIND, root=tmp_path).results
    assert [len(s.results) for s in sets] == [1, 1, 1] and [s.stale for s in sets] == [False, True, True]


def test_schema_1_results_are_read_and_their_table_cleaned_once_replaced(tmp_path):
    """Results written before the content-addressed tables (schema 1: ``<kind>-<key>.parquet``, no hash) are
    read, as stale; once a new result replaces one, its old table goes with the next clean past the grace."""
    key = R.result_key({"legacy": 1})
    folder = tmp_path / "m"
    folder.mkdir()
    table = pd.DataFrame({"n": [1, 1]})
    table.to_parquet(folder / f"{KIND}-{key}.parquet", index=False)
    (folder / f"{KIND}-{key}.json").write_text(json.dumps({
        "schema_version": 1, "kind": KIND, "model": "m", "key": key, "has_table": True,
        "provenance": {"command": "python -m pace_core all"}, "data": {"n": 1}}))
    got = R.load_result(KIND, "m", key, root=tmp_path)
    assert got.stale and got.data == {"n": 1}
    pd.testing.assert_frame_equal(got.table, table)
    R.save_result(KIND, "m", key, {"n": 2}, _prov(), _table(np.random.default_rng(7), 2), root=tmp_path)
    assert (folder / f"{KIND}-{key}.parquet").exists()
    assert R.clean_results(folder, grace_s=0) == [folder / f"{KIND}-{key}.parquet"]


def test_results_are_readable_like_plainly_created_files(tmp_path):
    """Files get 0o666 less the umask, as a plainly created file does (mkstemp's files were private)."""
    old = os.umask(0o022)
    try:
        R.save_result(KIND, "m", R.result_key({"p": 1}), {}, _prov(), pd.DataFrame({"x": [1.0]}), root=tmp_path)
    finally:
        os.umask(old)
    modes = {p.suffix: p.stat().st_mode & 0o777 for p in (tmp_path / "m").iterdir()}
    assert modes == {".json": 0o644, ".parquet": 0o644}


def test_a_provenance_names_the_command_that_ran(monkeypatch):
    """Without a command given, a result's provenance names this process's (pace_core.provenance.invocation)."""
    monkeypatch.setattr(sys, "argv", [str(REPO / "pace_core" / "__main__.py"), "card", "--quiet"])
    assert R.make_provenance("m")["command"] == "python -m pace_core card --quiet"


def test_keys_names_and_provenance(tmp_path, monkeypatch):
    assert R.result_key({"a": 1, "b": [1, 2]}) == R.result_key({"b": [1, 2], "a": 1})
    assert R.result_key({"a": 1}) != R.result_key({"a": 2})
    assert R.model_folder_name("Qwen/Qwen3.5-4B") == "Qwen--Qwen3.5-4B"
    ck = tmp_path / "ckpts" / "tiny-model"
    ck.mkdir(parents=True)
    assert R.model_folder_name(str(ck)) == "tiny-model"
    monkeypatch.setenv(R.RESULTS_ENV, str(tmp_path / "env"))
    assert R.results_dir("a/b") == tmp_path / "env" / "a--b"
    text = tmp_path / "t.txt"
    text.write_bytes(b"hello")
    prov = R.make_provenance("m", text_path=text, command="pace_core drift")
    assert prov["text"]["sha256"] == "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
    assert prov["command"] == "pace_core drift" and set(prov["versions"]) >= {"torch", "transformers", "pace_core"}
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert prov["method_version"] == METHOD_VERSION and prov["code"]["commit"] == head
    json.dumps(prov)
    for bad in [("Drift", "0" * 16), ("drift", "xyz")]:
        with pytest.raises(PaceError):
            R.load_result(bad[0], "m", bad[1], root=tmp_path)
    with pytest.raises(PaceError, match="model"):
        R.results_dir("  ")


SHIPPED = REPO / "data" / "results"


def test_the_shipped_results_are_current_and_sane():
    """Every result shipped in data/results reads, passes its checks and was made by this method version."""
    for folder in sorted(p for p in SHIPPED.iterdir() if p.is_dir()):
        listing = R.list_results(folder.name, root=SHIPPED)
        assert not listing.damaged, "\n".join(d.message for d in listing.damaged)
        stale = [r.path.name for r in listing.results if r.stale and r.kind != "model_card"]
        assert not stale, f"{len(stale)} stale results in {folder}, e.g. {stale[:3]}"


def test_the_shipped_results_were_made_from_a_clean_tree():
    """Every result file shipped in data/results names the commit that made it, a commit of this repository, and
    was made from that commit's code (``code.dirty`` false), so the code of every shipped number can be checked
    out (until 2026-12-06 none was: 76 of 76 recorded uncommitted changes)."""
    files = sorted(SHIPPED.glob("*/*.json"))
    unclean = []
    for path in files:
        code = json.loads(path.read_text(encoding="utf-8")).get("provenance", {}).get("code") or {}
        known = code.get("commit") and subprocess.run(
            ["git", "-C", str(REPO), "cat-file", "-e", f"{code['commit']}^{{commit}}"], capture_output=True
        ).returncode == 0
        if not known or code.get("dirty") is not False:
            unclean.append(path.name)
    assert files and not unclean, (f"{len(unclean)} of {len(files)} shipped result files were not made from a clean "
                                   f"commit of this repository, e.g. {unclean[:3]}")


def test_the_shipped_results_name_no_folder_of_the_machine_that_made_them():
    """A shipped file names its model and command as another machine would (the model's folder relative to the
    repository, ``python -m ...``), never a machine's absolute path (until 2026-12-06 all 79 named
    /work/wt-regen/...)."""
    files = sorted(SHIPPED.glob("*/*.json"))
    absolute = []
    for path in files:
        doc = json.loads(path.read_text(encoding="utf-8"))
        prov = doc.get("provenance") or {}
        named = [doc.get("model"), prov.get("model"), (prov.get("command") or "").split(" ")[0]]
        if any(isinstance(x, str) and x.startswith("/") for x in named):
            absolute.append(path.name)
    assert files and not absolute, f"{len(absolute)} of {len(files)} shipped files name absolute paths: {absolute[:3]}"


def test_the_drift_shipped_before_method_versions_is_refused_where_the_arithmetic_bounds_it(tmp_path):
    """The drift results shipped until 2026-12-04 (tests/data/drift-2026-12-01: made on cuda by the first wave's
    code, a median relative state error of 1.21 for every configuration) are refused for bf16, rtn-int8 and
    damp-int8, whose state error the arithmetic bounds; that of a 4-bit state has no such bound and reads, as
    stale."""
    folder = tmp_path / "pace-tiny-qwen35"
    shutil.copytree(Path(__file__).parent / "data" / "drift-2026-12-01" / "pace-tiny-qwen35", folder)
    listing = R.list_results(folder.name, "drift", root=tmp_path)
    refused = {json.loads(d.path.read_text())["data"]["config"]: d.reason for d in listing.damaged}
    assert sorted(refused) == ["bf16", "damp-int8", "rtn-int8"]
    assert "bf16's median relative state error is 1.208" in refused["bf16"]
    assert [r.data["config"] for r in listing.results] == ["pace-4"]
    assert all(r.stale for r in listing.results)
