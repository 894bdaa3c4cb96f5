import json
import os

import numpy as np
import pandas as pd
import pytest

from pace_core import results as R
from pace_core.errors import PaceError


def test_round_trip_json_and_parquet(tmp_path):
    rng = np.random.default_rng()
    table = pd.DataFrame({"step": np.arange(7), "rel_err": rng.random(7), "config": ["a"] * 7})
    key = R.result_key({"configs": ["a"], "tokens": 7, "x": rng.random()})
    prov = {"model": "Qwen/Qwen3.5-4B", "date": "2026-01-01T00:00:00+00:00"}
    data = {"mean": float(table.rel_err.mean()), "vec": np.arange(3)}
    saved = R.save_result("drift", "Qwen/Qwen3.5-4B", key, data, prov, table, root=tmp_path)
    folder = tmp_path / "Qwen--Qwen3.5-4B"
    assert sorted(p.name for p in folder.iterdir()) == [f"drift-{key}.json", f"drift-{key}.parquet"]
    got = R.load_result("drift", "Qwen/Qwen3.5-4B", key, root=tmp_path)
    assert got is not None and got == saved
    assert got.data == {"mean": data["mean"], "vec": [0, 1, 2]}
    pd.testing.assert_frame_equal(got.table, table)
    assert R.load_result("drift", "Qwen/Qwen3.5-4B", "0" * 16, root=tmp_path) is None
    assert R.load_result("sweep", "Qwen/Qwen3.5-4B", key, root=tmp_path) is None
    assert [r.key for r in R.list_results("Qwen/Qwen3.5-4B", root=tmp_path)] == [key]


def test_atomic_write_leaves_old_file_on_failure(tmp_path, monkeypatch):
    key = R.result_key({"a": 1})
    R.save_result("calibration", "m", key, {"v": 1}, {}, root=tmp_path)

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(RuntimeError):
        R.save_result("calibration", "m", key, {"v": 2}, {}, root=tmp_path)
    monkeypatch.undo()
    assert R.load_result("calibration", "m", key, root=tmp_path).data == {"v": 1}
    assert [p.name for p in (tmp_path / "m").iterdir()] == [f"calibration-{key}.json"]


def test_missing_parquet_or_corrupt_json_is_none(tmp_path):
    key = R.result_key({"b": 2})
    R.save_result("sweep", "m", key, {}, {}, pd.DataFrame({"x": [1.0]}), root=tmp_path)
    (tmp_path / "m" / f"sweep-{key}.parquet").unlink()
    assert R.load_result("sweep", "m", key, root=tmp_path) is None
    (tmp_path / "m" / f"sweep-{key}.json").write_text("{not json")
    assert R.load_result("sweep", "m", key, root=tmp_path) is None


@pytest.mark.parametrize("damage", ["truncated parquet", "json list", "not utf-8", "no provenance"])
def test_damaged_results_are_skipped(tmp_path, damage):
    """A damaged stored result reads as absent and the others are still listed (the app's pages show
    what is readable)."""
    good, bad = R.result_key({"good": 1}), R.result_key({"bad": 1})
    for key in (good, bad):
        R.save_result("sweep", "m", key, {"k": key}, {"date": key}, pd.DataFrame({"x": [1.0, 2.0]}), root=tmp_path)
    base = tmp_path / "m" / f"sweep-{bad}"
    doc = json.loads(base.with_suffix(".json").read_text())
    if damage == "truncated parquet":
        base.with_suffix(".parquet").write_bytes(base.with_suffix(".parquet").read_bytes()[:40])
    elif damage == "json list":
        base.with_suffix(".json").write_text("[]")
    elif damage == "not utf-8":
        base.with_suffix(".json").write_bytes(b"\xff\xfe{")
    else:
        del doc["provenance"]
        base.with_suffix(".json").write_text(json.dumps(doc))
    assert R.load_result("sweep", "m", bad, root=tmp_path) is None
    assert [r.key for r in R.list_results("m", root=tmp_path)] == [good]


def test_results_are_readable_like_plainly_created_files(tmp_path):
    """Files get 0o666 less the umask, as a plainly created file does (mkstemp's files were private)."""
    old = os.umask(0o022)
    try:
        key = R.result_key({"p": 1})
        R.save_result("sweep", "m", key, {}, {}, pd.DataFrame({"x": [1.0]}), root=tmp_path)
    finally:
        os.umask(old)
    for suffix in (".json", ".parquet"):
        assert (tmp_path / "m" / f"sweep-{key}{suffix}").stat().st_mode & 0o777 == 0o644


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
    json.dumps(prov)
    for bad in [("Drift", "0" * 16), ("drift", "xyz")]:
        with pytest.raises(PaceError):
            R.load_result(bad[0], "m", bad[1], root=tmp_path)
    with pytest.raises(PaceError, match="model"):
        R.results_dir("  ")
