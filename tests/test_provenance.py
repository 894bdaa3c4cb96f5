"""pace_core.provenance: what made a number (the command, the code, the host, the versions)."""

import datetime as dt
import os
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

from pace_core import provenance as P
from pace_core.version import code_commit

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv, command", [
    ([str(REPO / "pace_core" / "__main__.py"), "card", "--quiet"], "python -m pace_core card --quiet"),
    ([str(REPO / "pace_core" / "vllm" / "bench.py"), "--runs", "2"], "python -m pace_core.vllm.bench --runs 2"),
    ([str(REPO / "scripts" / "measure_app.py"), "--repeats", "1"], "python scripts/measure_app.py --repeats 1"),
    ([str(REPO / "kernels" / "bench" / "bench.py"), "--out", "x"], "python kernels/bench/bench.py --out x"),
    (["/opt/venv/bin/pace", "all"], "pace all"),
    (["/home/u/.local/bin/streamlit", "run", "app.py"], "streamlit run app.py"),
    (["/tmp/elsewhere/run.py", "-x"], "python run.py -x"),
])
def test_the_command_is_what_another_machine_types(monkeypatch, argv, command):
    """The command names no folder of this machine: a module of the repository as ``python -m``, a script by its
    path in the repository, another program by its name."""
    monkeypatch.setattr(sys, "argv", argv)
    assert P.invocation() == command


def test_a_measurements_provenance_names_its_command_code_host_and_versions(monkeypatch):
    """measurement(): the command without this machine's paths, the code as code_commit() knows it (a copied tree's
    own commit included), a UTC date of now, this host's CPU and the libraries' versions."""
    monkeypatch.setattr(sys, "argv", [str(REPO / "scripts" / "measure_memory.py"), "--device", "cpu"])
    before = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    prov = P.measurement()
    assert prov["command"] == "python scripts/measure_memory.py --device cpu"
    assert str(REPO) not in prov["command"] and sys.executable not in prov["command"]
    assert prov["code"] == code_commit() and prov["code"] is not None and len(prov["code"]["commit"]) == 40
    assert before <= dt.datetime.fromisoformat(prov["date"]) <= dt.datetime.now(dt.timezone.utc)
    assert prov["cpu_count"] == os.cpu_count() and prov["cpu"] == P.cpu_model()
    assert (prov["torch"], prov["cuda"]) == (torch.__version__, torch.version.cuda)
    assert prov["transformers"] == metadata.version("transformers") and prov["python"] == sys.version.split()[0]
    assert prov["gpus"] == ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                            if torch.cuda.is_available() else [])


def test_the_cpu_model_is_read_from_cpuinfo(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n")
    monkeypatch.setattr(P, "CPUINFO", info)
    assert P.cpu_model() == "Intel(R) Xeon(R) Platinum 8480+"
    monkeypatch.setattr(P, "CPUINFO", tmp_path / "absent")
    assert P.cpu_model() == P.platform.processor()


@pytest.mark.parametrize("provenance, label", [
    ({"code": {"commit": "0123456789abcdef" * 2 + "01234567", "dirty": False}}, "0123456789ab"),
    ({"code": {"commit": "c0ffee" * 7, "dirty": True}}, "c0ffeec0ffee with uncommitted changes"),
    ({"code": None}, "unknown"),
    ({}, "unknown"),
    ({"commit": "abcdef0123456789" * 2, "worktree_dirty": True}, "abcdef012345 with uncommitted changes"),
    ({"commit": "abcdef0123456789" * 2, "worktree_dirty": False}, "abcdef012345"),
])
def test_the_code_label_reads_the_code_and_the_fields_of_older_benchmark_files(provenance, label):
    """``code`` (measurement(), a stored result), or the ``commit`` and ``worktree_dirty`` of data/bench files
    written before it."""
    assert P.code_label(provenance) == label
