"""The plugin's entry point as vLLM loads it (vllm.plugins.load_general_plugins, in a fresh process) on the release it
supports and, with vLLM's version set to 0.33.0 before loading, on one it does not: nothing registered and one line,
or the process stopped with that line where a PACE configuration is asked for."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

LOAD = """
import vllm
{patch}
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.model_executor.custom_op import op_registry_oot
print("registered" if "QwenGatedDeltaNetAttention" in op_registry_oot else "not registered")
"""


def _load(version: str | None, config: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PACE_CONFIG"}
    if config:
        env["PACE_CONFIG"] = config
    patch = f"vllm.__version__ = {version!r}" if version else ""
    return subprocess.run([sys.executable, "-c", LOAD.format(patch=patch)], capture_output=True, text=True, env=env,
                          timeout=300)


def test_the_supported_release_registers_the_plugin():
    import vllm

    from pace_core.vllm import unsupported

    assert unsupported(vllm.__version__) is None
    out = _load(None)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "registered", out.stderr[-2000:]
    assert "not supported" not in out.stderr


def test_vllm_033_gets_one_line_and_vllms_own_state():
    out = _load("0.33.0")
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "not registered", out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if "PACE: vLLM 0.33.0 is not supported" in line]
    assert len(lines) == 1 and "supported: vLLM 0.32.x" in lines[0]


def test_vllm_033_asked_for_a_configuration_stops_with_that_line():
    out = _load("0.33.0", config="pace-4")
    assert out.returncode == 1 and "registered" not in out.stdout
    assert out.stderr.strip().splitlines()[-1].startswith("PACE: vLLM 0.33.0 is not supported by the PACE plugin "
                                                          "(supported: vLLM 0.32.x)")
