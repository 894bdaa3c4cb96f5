"""``vllm serve`` as the README and the Export page print it (:func:`pace_core.vllm.settings.serve_command`),
run as a subprocess (:class:`pace_core.vllm.bench.VllmServer`) on the embedded model in the environment
``make vllm-env`` builds, queried over HTTP with the OpenAI client, and stopped with Ctrl-C; and a file it
refuses, before an engine starts.

The served command gets a free port and ``--max-model-len 512`` (the embedded model's 8,192 are not needed);
state and cache memory come from ``VLLM_CPU_KVCACHE_SPACE`` (``make test-vllm``: 1 GiB). vLLM runs its
engine in its own processes here, as it does for a user.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from pace_core import accounting  # noqa: E402
from pace_core.export import read_config  # noqa: E402
from pace_core.model.loading import load_model  # noqa: E402
from pace_core.vllm import check  # noqa: E402
from pace_core.vllm.bench import VllmServer  # noqa: E402

PACE_4_8 = check.SHIPPED_RESULTS / "config-pace-4-8.json"

pytestmark = pytest.mark.vllm

MEMORY = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}


def test_the_documented_command_serves_the_openai_client(tmp_path: Path):
    log = tmp_path / "serve.log"
    server = VllmServer.start(check.EMBEDDED, str(PACE_4_8), log, ["--max-model-len", "512"], env=MEMORY)
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        model = client.models.list().data[0].id
        done = client.completions.create(model=model, prompt="The history of the city", max_tokens=24,
                                         temperature=0.0, extra_body={"return_token_ids": True, "ignore_eos": True})
        metrics = server.get("/metrics")
    finally:
        status = server.stop()
    assert status == 0, log.read_text()[-4000:]
    choice = done.choices[0]
    assert done.usage.completion_tokens == len(choice.token_ids) == 24 and choice.finish_reason == "length"
    # the served tokens are what the transformers path picks under the same configuration, fed the same text
    loaded = load_model(str(check.EMBEDDED), dtype="bfloat16")
    assert check.agreement(loaded, str(PACE_4_8), [choice.prompt_token_ids], [choice.token_ids]) >= 0.95

    cfg = read_config(str(PACE_4_8)).config
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
    server = VllmServer.start(check.EMBEDDED, str(wrong), log, ["--max-model-len", "512"], env=MEMORY)
    status = server.proc.wait(timeout=120)
    text = log.read_text()
    assert status == 1, text[-4000:]
    assert "EngineCore" not in text and "Traceback" not in text
    source = json.loads(PACE_4_8.read_text())["model"]["source"]
    assert text.strip().splitlines()[-1] == (f"PACE: this configuration was made for {source!r} and does not fit this "
                                             "model: num_layers 12 in the file, 8 in the model. Export it again on "
                                             "this model.")
