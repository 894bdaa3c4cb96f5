"""``vllm serve`` as the README and the Export page print it (:func:`pace_core.vllm.settings.serve_command`),
run as a subprocess on the embedded model in the environment ``make vllm-env`` builds, queried over HTTP with
the OpenAI client, and stopped; and a file it refuses, before an engine starts.

The served command gets a free port and ``--max-model-len 512`` (the embedded model's 8,192 are not needed);
state and cache memory come from ``VLLM_CPU_KVCACHE_SPACE`` (``make test-vllm``: 1 GiB). vLLM runs its
engine in its own processes here, as it does for a user (``VLLM_ENABLE_V1_MULTIPROCESSING`` is removed).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from pace_core import accounting  # noqa: E402
from pace_core.model.deploy import load_document  # noqa: E402
from pace_core.model.loading import load_model  # noqa: E402
from pace_core.vllm import check  # noqa: E402
from pace_core.vllm.settings import serve_command  # noqa: E402

pytestmark = pytest.mark.vllm

PACE_4_8 = check.REPO_ROOT / "data" / "results" / "pace-tiny-qwen35" / "config-pace-4-8.json"
READY_S = 300
"""How long the server may take to answer /health (about 40 s on two shared cores)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(config: str, port: int, log: Path) -> subprocess.Popen:
    """``serve_command`` for the embedded model and ``config`` on ``port``, its output into ``log``."""
    argv = shlex.split(serve_command(str(check.EMBEDDED), config)) + ["--port", str(port), "--max-model-len", "512"]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # this environment's `vllm`
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return subprocess.Popen(argv, cwd=check.REPO_ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _wait_ready(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"vllm serve exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
        try:
            _get(f"http://127.0.0.1:{port}/health")
            return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"vllm serve not ready after {READY_S} s:\n{log.read_text()[-4000:]}")


def _stop(proc: subprocess.Popen) -> int:
    """Ctrl-C to the server's process group, as a user stops it; its exit status."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def test_the_documented_command_serves_the_openai_client(tmp_path: Path):
    port, log = _free_port(), tmp_path / "serve.log"
    proc = _start(str(PACE_4_8), port, log)
    try:
        _wait_ready(proc, port, log)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        model = client.models.list().data[0].id
        done = client.completions.create(model=model, prompt="The history of the city", max_tokens=24,
                                         temperature=0.0, extra_body={"return_token_ids": True, "ignore_eos": True})
        metrics = _get(f"http://127.0.0.1:{port}/metrics")
    finally:
        status = _stop(proc)
    assert status == 0, log.read_text()[-4000:]
    choice = done.choices[0]
    assert done.usage.completion_tokens == len(choice.token_ids) == 24 and choice.finish_reason == "length"
    # the served tokens are what the transformers path picks under the same configuration, fed the same text
    loaded = load_model(str(check.EMBEDDED), dtype="bfloat16")
    assert check.agreement(loaded, str(PACE_4_8), [choice.prompt_token_ids], [choice.token_ids]) >= 0.95

    cfg = load_document(str(PACE_4_8)).config
    text = log.read_text()
    found = re.search(r"PACE pace-4-8: (\d+) state slots .* in the same memory: (\d+) slots", text)
    assert found, text[-4000:]
    slots, own = map(int, found.groups())
    assert slots >= 3 * own  # the target for PACE-4/8 at the same memory
    assert 'pace_config_info{bits="4",config="pace-4-8",decode_period="8",high_bits="8",high_share="0.25"' in metrics
    assert f"pace_state_bytes_per_sequence {float(accounting.state_bytes_per_sequence(cfg, loaded.shape))}" in metrics
    assert f"pace_state_slots {float(slots)}" in metrics


def test_a_file_for_another_model_is_refused_before_an_engine_starts(tmp_path: Path):
    wrong = tmp_path / "other-model.json"
    wrong.write_text(PACE_4_8.read_text().replace('"num_layers": 8', '"num_layers": 12'))
    log = tmp_path / "serve.log"
    proc = _start(str(wrong), _free_port(), log)
    status = proc.wait(timeout=120)
    text = log.read_text()
    assert status == 1, text[-4000:]
    assert "EngineCore" not in text and "Traceback" not in text
    source = json.loads(PACE_4_8.read_text())["model"]["source"]
    assert text.strip().splitlines()[-1] == (f"PACE: this configuration was made for {source!r} and does not fit this "
                                             "model: num_layers 12 in the file, 8 in the model. Export it again on "
                                             "this model.")
