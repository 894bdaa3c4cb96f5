"""kernels/bench/sass.py on the CPU: the decode kernels compile for the H200 (sm_90a) with this machine's Triton,
the Gluon kernels included (they have no interpreter version, so this is its check where no GPU is), and the
report counts what the compiled code holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("variant", ["PACE-4 dP=8", "PACE-4/8 dP=8"])
def test_gluon_kernels_compile_for_the_h200(variant: str, tmp_path: Path) -> None:
    """The Gluon dots and flush kernels of both variants (PACE-4's symmetric codes with int8 records, PACE-4/8's
    4-bit heads with zero points, 4-bit grouped keys and bfloat16 values), and PACE-4's Gluon step, the step and the
    flush over a batch and over a state pool's slots."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "kernels/bench/sass.py", "--variant", variant, "--batch", "4",
                           "--kernel", "gluon_dots", "dots", "gluon_flush", "pool_gluon_flush", "gluon_step",
                           "pool_gluon_step", "--dump", str(tmp_path)],
                          cwd=ROOT, env={**env, "TRITON_CACHE_DIR": str(tmp_path / "cache")}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "sass.json").read_text())
    assert report["target"] == "sm_90a"
    pace4 = variant == "PACE-4 dP=8"
    steps = {"gluon_step", "pool_gluon_step"} if pace4 else set()
    assert set(report["kernels"]) == {"gluon_dots", "dots", "gluon_flush", "pool_gluon_flush"} | steps
    gluon, dots = report["kernels"]["gluon_dots"], report["kernels"]["dots"]
    assert gluon["stack_bytes"] == 0 and gluon["ops"].get("HMMA.16816.F32.BF16", 0) > 0
    assert gluon["ops"].get("PRMT", 0) > 0  # the inline-PTX unpacking is there
    assert "LDS.U8" not in gluon["ops"] and "STS.128" not in gluon["ops"]  # no byte-wise staging of the codes
    assert (tmp_path / "gluon_dots.sass").read_text().count("HMMA") == gluon["ops"]["HMMA.16816.F32.BF16"]
    assert dots["instructions"] > 0
    fl = report["kernels"]["gluon_flush"]  # the tile stays in registers: shared memory only for per-column values
    assert fl["stack_bytes"] == 0 and fl["shared_bytes"] <= 256 and fl["ops"].get("HMMA.16816.F32.BF16", 0) > 0
    assert fl["ops"].get("PRMT", 0) > 0 and "LDS.U8" not in fl["ops"]
    pool_fl = report["kernels"]["pool_gluon_flush"]  # the same work at the slots' addresses, for full buffers
    assert pool_fl["stack_bytes"] == 0 and pool_fl["ops"]["HMMA.16816.F32.BF16"] == fl["ops"]["HMMA.16816.F32.BF16"]
    if pace4:  # the dots' tensor-core products and unpacking, then the records in the same warp: no local memory
        st = report["kernels"]["gluon_step"]
        assert st["stack_bytes"] == 0 and st["ops"]["HMMA.16816.F32.BF16"] == gluon["ops"]["HMMA.16816.F32.BF16"]
        assert st["ops"].get("PRMT", 0) >= gluon["ops"]["PRMT"]
        pool = report["kernels"]["pool_gluon_step"]  # the same work at the slots' addresses
        assert pool["stack_bytes"] == 0 and pool["ops"]["HMMA.16816.F32.BF16"] == st["ops"]["HMMA.16816.F32.BF16"]


@pytest.mark.parametrize("settings,kernels", [
    (["gluon_step_warps=4", "flush_row_blocks=2"], {"gluon_step": (4, None), "gluon_flush": (1, None)}),
    (["gluon_step_warps=2", "step_maxnreg=112"], {"gluon_step": (2, 112)}),
])
def test_issue43_launch_settings_compile_for_the_h200(settings: list[str], kernels: dict, tmp_path: Path) -> None:
    """The launch settings the bench tries beside the defaults (kernels.settings.SplitSettings) compile for sm_90a: the
    Gluon step over 2 or 4 warps per head (each warp a 1 / W share of the tensor-core products, no local memory), the
    Gluon flush over blocks of key groups, a register cap kept."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "kernels/bench/sass.py", "--variant", "PACE-4 dP=8", "--batch", "4",
                           "--kernel", *kernels, "--settings", *settings, "--dump", str(tmp_path)],
                          cwd=ROOT, env={**env, "TRITON_CACHE_DIR": str(tmp_path / "cache")}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "sass.json").read_text())
    assert set(report["kernels"]) == set(kernels)
    for name, (warps, cap) in kernels.items():
        k = report["kernels"][name]
        assert k["stack_bytes"] == 0 and (cap is None or k["registers"] <= cap)
        assert k["ops"]["HMMA.16816.F32.BF16"] == (64 // warps if name == "gluon_step" else 32)  # one key group


def test_three_bit_kernels_compile_for_the_h200(tmp_path: Path) -> None:
    """PACE-3's split path (issue 48: 3-bit codes read as three byte planes of 24-bit words, unpacked in registers):
    the Triton dots kernel, the one-kernel step and the flush (over a batch and over a state pool's slots) compile for
    sm_90a, the products on tensor cores and
    nothing spilled to local memory; the Gluon kernels (4-bit codes only) are not launched for it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "kernels/bench/sass.py", "--variant", "PACE-3 dP=8", "--batch", "4",
                           "--dump", str(tmp_path)],
                          cwd=ROOT, env={**env, "TRITON_CACHE_DIR": str(tmp_path / "cache")}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "sass.json").read_text())
    assert report["target"] == "sm_90a"
    # no Gluon kernel takes 3-bit codes
    assert set(report["kernels"]) == {"dots", "records", "step", "pool_step", "flush", "pool_flush"}
    for name in ("dots", "step", "pool_step"):
        kernel = report["kernels"][name]
        assert kernel["stack_bytes"] == 0 and kernel["ops"].get("HMMA.16816.F32.BF16", 0) > 0
    flush = report["kernels"]["flush"]
    assert flush["stack_bytes"] == 0 and any(op.startswith(("HMMA", "HGMMA")) for op in flush["ops"])
    planes = ("dots", "step", "pool_step", "flush", "pool_flush")  # the codes read as byte planes
    assert all(report["kernels"][name]["ops"].get("LDG.E.U8", 0) > 0 for name in planes)
