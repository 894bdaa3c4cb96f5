import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pace_core import cli
from pace_core.accounting import resident_bits, sequences_that_fit, state_bytes, state_share
from pace_core.cli import bits
from pace_core.config import NAMED_CONFIGS, get_config
from pace_core.export import config_to_json
from pace_core.shapes import BUILTIN_SHAPES, load_shape

KEYS = {
    "model",
    "config",
    "code_bits",
    "scale_bits",
    "formula_bits",
    "payload_bits",
    "metadata_bits",
    "buffer_bits",
    "resident_bits",
    "c",
    "exact_bits",
    "paper_c",
    "decode_period",
    "sequences",
    "state_bytes",
    "state_share",
    "sequence_bits",
}
REPO = Path(__file__).resolve().parents[1]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_bits_json_for_one_config(capsys):
    rc, out, err = run(capsys, "bits", "--config", "pace-4-8", "--model", "qwen3.5-27b", "--json")
    assert rc == 0 and err == ""
    row = json.loads(out)
    assert set(row) == KEYS
    rb = resident_bits(get_config("pace-4-8"), BUILTIN_SHAPES["qwen3.5-27b"])
    assert (row["payload_bits"], row["metadata_bits"], row["buffer_bits"], row["resident_bits"], row["c"],
            row["exact_bits"]) == (rb.payload_bits, rb.metadata_bits, rb.buffer_bits, rb.resident_bits, rb.c,
                                   rb.exact_bits)
    assert (row["model"], row["config"], row["decode_period"], row["sequences"]) == ("qwen3.5-27b", "pace-4-8", 8, 64)
    assert row["state_bytes"] == state_bytes(get_config("pace-4-8"), BUILTIN_SHAPES["qwen3.5-27b"], 64)
    assert row["payload_bits"] == 5.65625


def test_bits_of_static_scales_per_sequence(capsys):
    """Static scales keep their ranges (and two int64 counts) once per layer: a sequence's bits drop by the scales'
    16/g, which the per-sequence figure shows (one sequence's resident bits count the ranges and counts too)."""
    shape = BUILTIN_SHAPES["qwen3.5-4b"]
    rc, out, _ = run(capsys, "bits", "--config", "pace-4", "--model", "qwen3.5-4b", "--scales", "static", "--json")
    row = json.loads(out)
    plain = resident_bits(get_config("pace-4"), shape)
    counts = shape.num_gdn_layers * 2 * 64 / shape.state_values
    assert rc == 0 and row["scale_bits"] == 0 and row["resident_bits"] == plain.resident_bits + counts
    assert row["sequence_bits"] == plain.sequence_bits - 16 / 64 == 8 * (
        state_bytes(get_config("pace-4-static"), shape, 2) - state_bytes(get_config("pace-4-static"), shape, 1)
    ) / shape.state_values
    rc, out, _ = run(capsys, "bits", "--config", "pace-4-static", "--model", "qwen3.5-4b")
    assert rc == 0 and f"per seq.  {row['sequence_bits']:9.5f}" in out


def test_bits_text_for_one_config_with_overrides_and_budget(capsys):
    rc, out, _ = run(capsys, "bits", "--config", "pace-4", "--model", "qwen3.5-4b", "--dp", "32", "--buffer", "bf16",
                     "--sequences", "8", "--budget-gb", "80")
    assert rc == 0
    cfg = get_config("pace-4").replace(decode_period=32, buffer="bf16")
    shape = BUILTIN_SHAPES["qwen3.5-4b"]
    rb = resident_bits(cfg, shape)
    assert out.startswith("pace-4 on qwen3.5-4b: 24 GDN layers of 32, 16 key / 32 value heads (γ = 2)")
    assert f"buffer    {rb.buffer_bits:9.5f}  (c = {rb.c:.6f} x dP 32, buffer scales included)" in out
    assert f"resident  {rb.resident_bits:9.5f}" in out
    assert f"state of 8 sequences: {state_bytes(cfg, shape, 8) / 2**30:.3f} GiB, " \
           f"{100 * state_share(cfg, shape, 8):.1f}% of weights + state" in out
    assert f"sequences that fit in 80 GB with the weights: {sequences_that_fit(cfg, shape, 80 * 10**9)}" in out
    rc, out, _ = run(capsys, "bits", "--config", "pace-4-8", "--model", "qwen3.5-4b", "--no-symmetric", "--json",
                     "--high-share", "0.5", "--bits", "3", "--axis", "value", "--group-size", "16")
    row = json.loads(out)
    cfg = get_config("pace-4-8").replace(high_share=0.5, bits=3, group_axis="value", group_size=16, symmetric=False)
    assert row["resident_bits"] == resident_bits(cfg, shape).resident_bits


def test_bits_table_of_all_named_configs(capsys):
    rc, out, _ = run(capsys, "bits", "--model", "qwen3.5-27b", "--json")
    rows = json.loads(out)
    assert rc == 0 and [r["config"] for r in rows] == list(NAMED_CONFIGS)
    for r in rows:
        rb = resident_bits(get_config(r["config"]), BUILTIN_SHAPES["qwen3.5-27b"])
        assert r["resident_bits"] == rb.resident_bits and r["exact_bits"] == rb.exact_bits
    rc, out, _ = run(capsys, "bits", "--model", "qwen3.5-27b", "--dp", "16", "--budget-gb", "141")
    lines = out.splitlines()
    assert rc == 0 and lines[0].startswith("qwen3.5-27b: 48 GDN layers")
    assert lines[1].split() == ["config", "payload", "metadata", "buffer", "resident", "per", "seq", "formula", "dP",
                                "state", "GiB", "share", "fit"]
    body = {line.split()[0]: line.split() for line in lines[3:3 + len(NAMED_CONFIGS)]}
    assert set(body) == set(NAMED_CONFIGS)
    assert body["fp32"][7] == "1" and body["pace-4"][7] == "16"  # overrides apply to the quantised configs
    pace = get_config("pace-4").replace(decode_period=16)
    assert body["pace-4"][4] == f"{resident_bits(pace, BUILTIN_SHAPES['qwen3.5-27b']).resident_bits:.4f}"
    assert body["pace-4"][-1] == str(sequences_that_fit(pace, BUILTIN_SHAPES["qwen3.5-27b"], 141 * 10**9))


def test_config_file_and_model_paths(capsys, tmp_path, tiny_checkpoints):
    cfg = get_config("pace-4-8").replace(decode_period=4, name="mine")
    path = tmp_path / "mine.json"
    path.write_text(config_to_json(cfg, model="qwen3.5-9b"))
    rc, out, _ = run(capsys, "bits", "--config", str(path), "--model", "qwen3.5-9b", "--json")
    expected = resident_bits(cfg, BUILTIN_SHAPES["qwen3.5-9b"]).resident_bits
    assert rc == 0 and json.loads(out)["resident_bits"] == expected
    ckpt = tiny_checkpoints["qwen3_5_moe"]
    for source in (ckpt, ckpt / "config.json"):
        rc, out, _ = run(capsys, "bits", "--config", "pace-4", "--model", str(source), "--json")
        row = json.loads(out)
        assert rc == 0 and row["model"] == "qwen3_5_moe"
        assert row["exact_bits"] == resident_bits(get_config("pace-4"), load_shape(str(ckpt))).exact_bits


@pytest.mark.parametrize("argv, message", [
    (["--config", "pace-5", "--model", "qwen3.5-4b"], "error: config 'pace-5' is unknown; allowed: fp32, bf16"),
    (["--config", "pace-4", "--model", "qwen3.5-4b", "--bits", "9"], "error: bits=9 is not allowed"),
    (["--config", "pace-4", "--model", "llama-7b"], "error: model 'llama-7b' is neither a built-in shape"),
    (["--config", "pace-4", "--model", "qwen3.5-4b", "--sequences", "0"], "error: --sequences=0 is not allowed"),
    (["--config", "missing.json", "--model", "qwen3.5-4b"], "error: config 'missing.json' cannot be read"),
    (["--config", "pace-4", "--model", "qwen3.5-4b", "--group-size", "48"], "error: group_size=48 is not allowed"),
])
def test_bad_input_exits_2_with_a_message(capsys, argv, message):
    rc, out, err = run(capsys, "bits", *argv)
    assert rc == 2 and out == "" and err.startswith(message) and "Traceback" not in err


def test_non_hybrid_checkpoint_and_group_not_dividing(capsys, tiny_checkpoints):
    rc, _, err = run(capsys, "bits", "--config", "pace-4", "--model", str(tiny_checkpoints["qwen3"]))
    assert rc == 2 and "is not a hybrid Gated DeltaNet model" in err
    # the tiny checkpoints have d_v = 32: value groups of 64 do not divide it
    rc, _, err = run(capsys, "bits", "--config", "rtn-int4", "--group-size", "64", "--model",
                     str(tiny_checkpoints["qwen3_5_text"]))
    assert rc == 2 and "group_size=64 does not divide the value axis" in err and "allowed: 1, 2, 4, 8, 16, 32" in err


def test_argparse_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["bits", "--axis", "row"])
    assert e.value.code == 2 and "invalid choice: 'row'" in capsys.readouterr().err


def test_commands_register_on_the_parser():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert "bits" in sub.choices and bits.register in cli.REGISTRARS
    args = parser.parse_args(["bits", "--model", "qwen3.5-4b"])
    assert args.func is bits.run_bits and args.config is None and args.sequences == 64


def test_subprocess_entry_point():
    ok = subprocess.run([sys.executable, "-m", "pace_core", "bits", "--config", "pace-4-8", "--model", "qwen3.5-27b",
                         "--json"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["resident_bits"] == resident_bits(get_config("pace-4-8"),
                                                                   BUILTIN_SHAPES["qwen3.5-27b"]).resident_bits
    bad = subprocess.run([sys.executable, "-m", "pace_core", "bits", "--config", "nope", "--model", "qwen3.5-27b"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: config 'nope' is unknown")
    assert "Traceback" not in bad.stderr and bad.stdout == ""


def test_a_broken_checkpoint_exits_2_with_an_error_line(capsys, broken_checkpoints, tmp_path):
    """`card --model DIR` on every broken checkpoint: README's `error: ...` line last and exit code 2, no traceback;
    one of them through the real entry point (10^7 layers: it hung in transformers' config)."""
    for folder, message in broken_checkpoints.values():
        rc, out, err = run(capsys, "card", "--model", str(folder), "--out", str(tmp_path), "--quiet")
        last = err.strip().splitlines()[-1]  # after transformers' own loading bar and report
        assert rc == 2 and last.startswith("error: ") and message in last and "Traceback" not in err, err
    folder, message = broken_checkpoints["10^7 layers"]
    done = subprocess.run([sys.executable, "-m", "pace_core", "card", "--model", str(folder), "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error: ") and message in done.stderr, done.stderr
