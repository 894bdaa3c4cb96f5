"""The wheel installs beside Hugging Face's ``kernels`` (the kernel hub package, which transformers can use):
ours installs as ``pace_kernels``, both import, and pace_core runs one of our kernels (Triton's interpreter).

Built from a copy of the sources (the build leaves nothing in the worktree) and installed into a fresh
virtual environment that sees this interpreter's packages (torch, triton, transformers) through a .pth
file, so nothing large is downloaded: ``kernels`` comes from the package registry (its own small
dependencies too), and where the registry cannot be reached, from a stand-in distribution of that name
built here (a package ``kernels`` with one module), which tests the same clash of names.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PIP = ("-m", "pip", "--disable-pip-version-check", "-q")

pytestmark = pytest.mark.slow

RUN_OURS = """
import kernels, pace_core, pace_kernels, torch
from pace_core import quant
from pace_core.backend import kernels_module
import importlib.metadata
print("kernels", kernels.__file__, importlib.metadata.version("kernels"), hasattr(kernels, "get_kernel"))
qp = kernels_module("quantize")
assert qp.__name__ == "pace_kernels.quantize", qp.__name__
torch.manual_seed(0)
x = torch.randn(2, 3, 16, 32)
spec = quant.QuantSpec(4, True, "key", 8)
got, ref = qp.quantize(x, spec), quant.quantize(x, spec)
assert torch.equal(got.codes, ref.codes) and torch.equal(got.scale, ref.scale)
from pace_core.pool_cpu import SOURCE, library
assert library() is None and SOURCE.is_file(), library()
print("ours", pace_kernels.__file__)
"""
"""Imports both, checks that pace_core resolves its kernels to ``pace_kernels`` and runs the quantise kernel
against the reference (bit-identical, as tests/test_kernels_quantize.py holds it), and loads the fused CPU step from
the installed source (pace_core.pool_cpu)."""


ENV = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "TRITON_INTERPRET": "1"}
"""The environment of every command: without this worktree on the path (so ``kernels`` is not found there)."""


def _run(*args: str | os.PathLike, cwd: Path) -> str:
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{args}: {done.stdout}\n{done.stderr}"
    return done.stdout


def _wheel(tmp: Path) -> Path:
    """The project's wheel, built from a copy of the files the build reads."""
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("pace_core", "kernels"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    _run(sys.executable, *PIP, "wheel", ".", "--no-deps", "--no-build-isolation", "-w", tmp / "dist", cwd=src)
    return next((tmp / "dist").glob("pace_studio-*.whl"))


def _stand_in(tmp: Path) -> Path:
    """A distribution named ``kernels`` with a package ``kernels`` of one module."""
    src = tmp / "kernels-stand-in"
    (src / "kernels").mkdir(parents=True)
    (src / "kernels" / "__init__.py").write_text('"""Stand-in of the kernel hub package."""\nHUB = True\n')
    (src / "pyproject.toml").write_text('[project]\nname = "kernels"\nversion = "0.0.1"\n'
                                        '[tool.setuptools]\npackages = ["kernels"]\n')
    _run(sys.executable, *PIP, "wheel", ".", "--no-deps", "--no-build-isolation", "-w", tmp / "dist", cwd=src)
    return next((tmp / "dist").glob("kernels-*.whl"))


def test_the_wheel_installs_beside_the_kernel_hub_package(tmp_path: Path):
    wheel = _wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {f"pace_core/{p.relative_to(REPO / 'pace_core').as_posix()}" for p in (REPO / "pace_core").rglob("*.py")
               if "__pycache__" not in p.parts}
    sources |= {f"pace_kernels/{p.name}" for p in (REPO / "kernels").glob("*.py")}
    sources |= {f"pace_core/csrc/{p.name}" for p in (REPO / "pace_core" / "csrc").glob("*.cpp")}
    assert sources <= names, sorted(sources - names)
    assert not any(n.startswith("kernels/") for n in names)

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    py = venv / "bin" / "python"
    purelib = Path(_run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path).strip())
    (purelib / "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    hub = subprocess.run([py, *PIP, "install", "kernels"], env=ENV, capture_output=True, text=True, timeout=600)
    if hub.returncode != 0:  # no registry: the same clash of names with a stand-in
        _run(py, *PIP, "install", _stand_in(tmp_path), cwd=tmp_path)
    _run(py, *PIP, "install", "--no-deps", wheel, cwd=tmp_path)

    out = _run(py, "-c", RUN_OURS, cwd=tmp_path)
    version, hub_api = ("0.0.1", "False") if hub.returncode else (out.split()[2], "True")  # get_kernel: the hub's
    assert f"kernels {purelib / 'kernels' / '__init__.py'} {version} {hub_api}" in out
    assert f"ours {purelib / 'pace_kernels' / '__init__.py'}" in out
