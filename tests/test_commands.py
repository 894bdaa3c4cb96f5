import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

import pace_core
from pace_core.analysis.text import TEST_TEXT
from pace_core.cli import context as commands
from pace_core.cli import main
from pace_core.cli.calibration import export_differences
from pace_core.config import NAMED_CONFIGS
from pace_core.export import config_from_dict, config_from_json
from pace_core.results import config_hash, list_results, result_sets

PACE_MAIN = str(Path(pace_core.__file__).parent / "__main__.py")
"""``sys.argv[0]`` under ``python -m pace_core``: what a stored result's command and the resume hint name."""


@pytest.fixture(scope="module")
def env(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("cmd")
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    text = root / "text.txt"
    text.write_text("".join(chr(c) for c in torch.randint(32, 127, (400,), generator=g).tolist()))
    return {"model": str(tiny_checkpoints["qwen3_5_text"]), "out": str(root / "results"), "text": str(text),
            "qwen3": str(tiny_checkpoints["qwen3"]), "root": root}


@pytest.fixture
def bars(monkeypatch):
    """Every progress bar a command opens, counting even under --quiet (written to a string): ``(desc, bar)``."""
    import io

    from tqdm import tqdm

    opened = []

    def bar(self, total: int, desc: str):
        opened.append((desc, tqdm(total=total, desc=desc, file=io.StringIO())))
        return opened[-1][1]

    monkeypatch.setattr(commands.Context, "bar", bar)
    return opened


def _assert_filled(bars):
    """Each bar ends at its total: the total announced (and so the time-left estimate) was the work done."""
    assert bars
    for desc, bar in bars:
        assert bar.n == bar.total, f"{desc}: {bar.n} units done, {bar.total} announced"


def _run(env, *argv):
    return main([argv[0], "--model", env["model"], "--out", env["out"], "--quiet", *argv[1:]])


def test_card_prints_and_stores_the_checkpoint_card(env, capsys, monkeypatch):
    from pace_core.model.card import load_card

    monkeypatch.setattr(commands, "_CONTEXTS", {})  # a model loaded by an earlier test stored its card elsewhere
    assert _run(env, "card") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "card stored"
    lines = dict(line.split(None, 1) for line in out[:-1] if line.strip())
    card = load_card(env["model"], env["model"], "float32", root=env["out"])
    assert lines["weights_fingerprint"] == card.fingerprint and lines["gdn_layers"] == "3"
    assert lines["params"] == str(card.summary["params"]) and "dtype" not in lines


def test_calibrate_export_and_reuse(env, capsys):
    assert _run(env, "calibrate", "--text", env["text"], "--tokens", "128", "--sample-every", "32") == 0
    out = capsys.readouterr().out
    assert "high_heads: ((" in out and "saved" in out
    [cal] = list_results(env["model"], "calibration", root=env["out"]).results
    assert len(cal.table) == 4 * 3 and cal.table.high.sum() == 3
    dest = env["root"] / "cfg.json"
    assert _run(env, "export", "--text", env["text"], "--tokens", "128", "--sample-every", "32",
                "--output", str(dest)) == 0
    out = capsys.readouterr().out
    assert "saved" not in out  # the stored calibration was reused
    cfg = config_from_json(dest.read_text())
    assert cfg.high_heads == config_from_dict(cal.data["config"]).high_heads
    assert cfg.high_heads == tuple((int(t[t.gdn_index == i].sort_values("E").iloc[-1]["head"]),) for i, t in
                                   cal.table.groupby("gdn_index"))
    assert [len(h) for h in cfg.high_heads] == [1, 1, 1]


def test_drift_perplexity_generate_sweep(env, capsys):
    drift = ("drift", "--text", env["text"], "--tokens", "40", "--decode-from", "24", "--every", "4")
    assert _run(env, *drift, "--configs", "rtn-int4") == 0
    [r] = list_results(env["model"], "drift", root=env["out"]).results
    assert set(r.table.columns) >= {"config", "step", "rel_error", "excess_nll"}
    assert set(r.table.config) == {"rtn-int4"} and r.provenance["text"]["sha256"]
    capsys.readouterr()
    # a second configuration is computed alone: the stored one is reused, one result per configuration
    assert _run(env, *drift, "--configs", "rtn-int4", "rtn-int8") == 0
    out = capsys.readouterr().out
    assert "reusing stored drift of rtn-int4" in out and out.count("saved") == 1
    [drift_set] = result_sets(env["model"], "drift", root=env["out"]).results
    assert drift_set.configs == ["rtn-int4", "rtn-int8"] and set(drift_set.table.config) == {"rtn-int4", "rtn-int8"}
    assert _run(env, "perplexity", "--text", env["text"], "--window", "64", "--stride", "32", "--max-tokens", "96",
                "--configs", "rtn-int8") == 0
    [p] = result_sets(env["model"], "perplexity", root=env["out"]).results
    assert list(p.table.config) == ["fp32", "rtn-int8"] and (p.table.ppl > 1).all()
    assert p.rows("decode_from") == [32, 32] and p.table.kl[1] > 0  # scored tokens decoded by default
    assert _run(env, "generate", "--prompt", "Hello", "--max-new-tokens", "4", "--configs", "rtn-int4",
                "--modes", "greedy") == 0
    [gr] = result_sets(env["model"], "generation", root=env["out"]).results
    assert list(gr.table.config) == ["fp32", "rtn-int4"]
    assert _run(env, "sweep", "--text", env["text"], "--tokens", "64", "--decode-tokens", "16", "--bits", "4", "8",
                "--dp", "1", "8", "--axis", "key") == 0
    [sw] = list_results(env["model"], "sweep", root=env["out"]).results
    assert len(sw.table) == 4 and (sw.table.final_rel_error > 0).all()
    assert isinstance(sw.table, pd.DataFrame) and sw.data["mode"] == "layer-local"


def test_perplexity_whole_text_in_batches(env, tmp_path):
    out = str(tmp_path / "results")
    common = ["perplexity", "--model", env["model"], "--quiet", "--text", env["text"], "--window", "64",
              "--stride", "32", "--configs", "rtn-int4"]
    assert main([*common, "--out", out, "--max-tokens", "0", "--batch", "4"]) == 0
    [p] = result_sets(env["model"], "perplexity", root=out).results
    assert list(p.table.tokens) == [399, 399]  # 400 one-character tokens, all but the first scored
    assert main([*common, "--out", str(tmp_path / "one"), "--max-tokens", "400"]) == 0
    [q] = result_sets(env["model"], "perplexity", root=str(tmp_path / "one")).results
    # same scores up to summation order (batched matmuls): tight for the unquantised reference; for the
    # quantised rows that order can move a rounding boundary (see test_analysis_quality)
    assert p.table.nll[0] == pytest.approx(q.table.nll[0], rel=1e-6)
    assert p.table.nll.to_numpy() == pytest.approx(q.table.nll.to_numpy(), rel=1e-3)


def test_compare_stores_every_point_the_frontier_and_reuses_perplexity(env, capsys, tmp_path):
    from pace_core.accounting import capacity, resident_bits
    from pace_core.shapes import load_shape

    out = str(tmp_path / "results")
    common = ["--model", env["model"], "--out", out, "--quiet", "--text", env["text"], "--window", "64",
              "--max-tokens", "128"]
    compare = ["compare", *common, "--calibration-text", env["text"], "--calibration-tokens", "64", "--configs",
               "rtn-int4", "rtn-int8", "pace-4", "stepquant-4"]
    assert main(compare) == 0
    printed = capsys.readouterr().out
    [cmp] = list_results(env["model"], "compare", root=out).results
    [ppl] = result_sets(env["model"], "perplexity", root=out).results
    rows = {r.data["config"]: r.data["row"] for r in ppl.results}
    points = cmp.data["points"]
    assert [p["config"] for p in points] == ["fp32", "rtn-int4", "rtn-int8", "pace-4", "stepquant-4"]
    shape = load_shape(env["model"])
    for p in points:  # the accounting's bits of the configuration as run, the perplexity command's figures
        cfg = config_from_dict(p["configuration"])
        assert p["resident_bits"] == resident_bits(cfg, shape).resident_bits
        assert {k: p[k] for k in ("kl", "agreement", "bpb", "tokens")} == {
            k: rows[p["config"]][k] for k in ("kl", "agreement", "bpb", "tokens")}
    assert config_from_dict(points[-1]["configuration"]).calibrated is not None  # STEPQuant calibrated on the model
    # the frontier, computed here: a point whose KL is below that of every point of fewer bits, lowest of its bits
    on = [p["config"] for p in sorted(points, key=lambda p: p["resident_bits"])
          if all(p["kl"] < q["kl"] for q in points if q["resident_bits"] < p["resident_bits"])
          and p["kl"] == min(q["kl"] for q in points if q["resident_bits"] == p["resident_bits"])]
    assert cmp.data["frontier"] == on and "fp32" in on
    assert f"frontier (no configuration with fewer bits and lower KL): {', '.join(on)}" in printed
    assert list(cmp.table.config) == [p["config"] for p in sorted(points, key=lambda p: (p["resident_bits"], p["kl"]))]
    # each configuration's result holds its per-window sums
    for r in ppl.results:
        assert r.table.tokens.sum() == r.data["row"]["tokens"] and set(r.table.config) == {r.data["config"]}
    # the perplexity command with the same settings reuses them; compare reuses its own result
    assert main(["perplexity", *common, "--configs", "pace-4"]) == 0
    printed = capsys.readouterr().out
    assert "reusing stored perplexity of fp32, pace-4" in printed and "saved" not in printed
    assert main(compare) == 0
    assert "reusing stored compare" in capsys.readouterr().out
    # without --window, --max-tokens, --text or --configs: the stored comparison of any window, named, no measuring;
    # with a budget, the frontier and then, last, the recommendation (issue 46: no budget option, a silent re-run)
    short = ["compare", "--model", env["model"], "--out", out, "--quiet"]
    configs = {p["config"]: config_from_dict(p["configuration"]) for p in points}
    sq4_bits = next(p["resident_bits"] for p in points if p["config"] == "stepquant-4")
    best = min((p["kl"], p["resident_bits"], p["config"]) for p in points if p["resident_bits"] <= sq4_bits)[2]
    assert main([*short, "--budget-bits", str(sq4_bits)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith(f"using the stored comparison {cmp.path}: windows of 64 tokens, "
                               f"{cmp.data['tokens']:,} scored tokens of text.txt, made by commit ")
    assert "--force to measure again" in lines[0] and "saved" not in "".join(lines)
    assert lines[-3] == printed_frontier(cmp) and lines[-1] == f"recommended: {best}"
    assert main([*short, "--budget-bits", "1"]) == 0
    fewest = min(points, key=lambda p: p["resident_bits"])
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        f"recommended: none — the fewest, {fewest['config']}, takes {fewest['resident_bits']:.4f} bits per state "
        "value, above 1")
    for memory, sequences, context in ((10**8, 50, 0), (10**8, 400, 256), (3 * 10**7, 7, 0), (10**6, 1, 0)):
        argv = [*short, "--memory", str(memory), "--sequences", str(sequences), "--context", str(context),
                "--weight-bits", "16"]
        assert main(argv) == 0
        holds = [(p["kl"], p["resident_bits"], p["config"]) for p in points
                 if capacity(configs[p["config"]], shape, memory, weight_bits=16, context=context).sequences
                 >= sequences]
        last = capsys.readouterr().out.strip().splitlines()[-1]
        assert last == f"recommended: {min(holds)[2]}" if holds else last.startswith("recommended: none — ")
    ppl_best = min((p["ppl"], p["resident_bits"], p["config"]) for p in points if p["resident_bits"] <= sq4_bits)[2]
    assert main([*short, "--budget-bits", str(sq4_bits), "--axis", "ppl"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"recommended: {ppl_best}"
    assert main([*short, "--sequences", "3"]) == 2
    assert "--sequences without a budget" in capsys.readouterr().err


def printed_frontier(result) -> str:
    return f"frontier (no configuration with fewer bits and lower KL): {', '.join(result.data['frontier'])}"


def test_stored_results_belong_to_the_weights(env, capsys, tmp_path):
    """A checkpoint retrained in place gets its own results: the cache key holds the weights' fingerprint."""
    from pace_core.model.loading import load_model

    folder = tmp_path / "model"
    loaded = load_model(env["model"])
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    argv = ["perplexity", "--model", str(folder), "--out", str(tmp_path / "results"), "--quiet", "--text",
            env["text"], "--window", "32", "--stride", "16", "--max-tokens", "64", "--configs", "rtn-int8"]
    assert main(argv) == 0 and main(argv) == 0
    assert "reusing stored perplexity" in capsys.readouterr().out
    with torch.no_grad():
        next(loaded.model.parameters()).view(-1)[0] += 1.0
    loaded.model.save_pretrained(folder)
    commands._CONTEXTS.clear()  # as a new process would: the CLI keeps one loaded model per process
    assert main(argv) == 0
    assert "reusing" not in capsys.readouterr().out
    results = list_results(str(folder), "perplexity", root=str(tmp_path / "results")).results
    assert len(results) == 4 and len({r.provenance["weights"] for r in results}) == 2  # fp32 + rtn-int8, twice


def test_damp_results_follow_their_calibration(env, capsys, tmp_path):
    """DAMP's outlier rows come from calibration, not from its config: a run calibrated on another text
    is not served the stored result of the first."""
    out = str(tmp_path / "results")
    other = tmp_path / "other.txt"
    other.write_text("the state of a gated delta net layer " * 20)
    argv = ["perplexity", "--model", env["model"], "--out", out, "--quiet", "--text", env["text"], "--window", "32",
            "--stride", "16", "--max-tokens", "64", "--configs", "damp-int4", "--calibration-tokens", "64"]
    assert main([*argv, "--calibration-text", env["text"]]) == 0
    assert main([*argv, "--calibration-text", env["text"]]) == 0
    assert "reusing stored perplexity" in capsys.readouterr().out
    assert main([*argv, "--calibration-text", str(other)]) == 0
    printed = capsys.readouterr().out  # the fp32 reference does not depend on calibration; damp-int4 does
    assert "reusing stored perplexity of fp32 " in printed and "damp-int4 (" not in printed
    rows = [r.data["config"]["pace"]["calibrated"] for r in list_results(env["model"], "calibration", root=out).results]
    assert len(rows) == 2 and rows[0] != rows[1]  # two calibrations with different rows
    configs = [r.data["config"] for r in list_results(env["model"], "perplexity", root=out).results]
    assert sorted(configs) == ["damp-int4", "damp-int4", "fp32"]  # the reference once, damp per calibration


def test_perplexity_with_stride_equal_to_window_still_decodes(env, tmp_path):
    """No context tokens per window (stride = window): one prompt token, the rest decoded, so the state's
    rounding shows (a whole-window prefill with P >= window would hide it)."""
    out = str(tmp_path / "results")
    assert main(["perplexity", "--model", env["model"], "--out", out, "--quiet", "--text", env["text"],
                 "--window", "32", "--stride", "32", "--max-tokens", "64", "--configs", "rtn-int2"]) == 0
    [p] = result_sets(env["model"], "perplexity", root=out).results
    assert p.rows("decode_from") == [1, 1] and p.table.kl[1] > 0
    assert main(["perplexity", "--model", env["model"], "--out", out, "--quiet", "--text", env["text"],
                 "--window", "32", "--max-tokens", "64", "--configs", "rtn-int2"]) == 0  # stride: half the window
    assert {r.data["decode_from"] for r in list_results(env["model"], "perplexity", root=out).results} == {1, 16}


def test_drift_says_when_tokens_ask_for_more_than_the_text(env, capsys):
    """Before: --tokens 1000000000 silently meant the whole text."""
    assert _run(env, "drift", "--text", env["text"], "--tokens", "1000000000", "--every", "8", "--configs", "fp32") == 0
    out = capsys.readouterr().out
    [r] = [r for r in list_results(env["model"], "drift", root=env["out"]).results if r.data["config"] == "fp32"]
    assert (f"drift: --tokens 1,000,000,000 is more than the text holds: using the whole text, "
            f"{r.data['tokens']:,} tokens") in out


def test_errors_exit_2(env, capsys, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    cases = [
        (("drift", "--text", str(tmp_path / "missing.txt")), "does not exist"),
        (("perplexity", "--text", str(empty)), "empty"),
        (("calibrate", "--text", str(TEST_TEXT)), "test split"),
        (("drift", "--configs", "nope"), "unknown"),
    ]
    small = ("--text", env["text"], "--max-tokens", "64", "--window", "32", "--configs", "rtn-int8")
    cases += [
        (("calibrate", "--text", env["text"], "--tokens", "128", "--sample-every", "0"), "--sample-every: 0"),
        (("perplexity", *small, "--decode-from", "0"), "--decode-from: 0 not allowed; allowed: 1..31"),
        (("perplexity", *small, "--decode-from", "32"), "--decode-from: 32 not allowed"),
        (("sweep", "--text", env["text"], "--tokens", "64", "--decode-tokens", "16", "--prefill-period", "0"),
         "prefill_period=0 is not allowed"),
        (("structure", "--text", env["text"], "--out", env["text"]), "allowed: a path this process can write"),
    ]
    for argv, msg in cases:
        assert _run(env, *argv) == 2
        assert msg in capsys.readouterr().err
    for budget in ("nan", "inf", "-1"):
        assert main(["bits", "--config", "pace-4", "--budget-gb", budget]) == 2
        assert "--budget-gb" in capsys.readouterr().err
    assert main(["drift", "--model", env["qwen3"], "--out", env["out"], "--quiet"]) == 2
    assert "not a hybrid" in capsys.readouterr().err
    assert main(["drift", "--model", str(tmp_path / "nowhere"), "--quiet"]) == 2
    assert "does not exist" in capsys.readouterr().err


def _file_for(tmp_path, name: str, shape, fingerprint: str | None, edit=None) -> str:
    """An export of PACE-4/8 (its heads 0 and 1 of every GDN layer) for ``shape``, edited by ``edit(doc)``."""
    import json

    from pace_core.config import get_config
    from pace_core.export import export_document

    cfg = get_config("pace-4-8").replace(high_heads=((0,),) * shape.num_gdn_layers)
    doc = export_document(cfg, shape=shape, source="elsewhere", weights_fingerprint=fingerprint)
    if edit is not None:
        edit(doc)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_a_file_for_another_model_or_with_disagreeing_sections_exits_2_and_stores_nothing(env, tmp_path, capsys,
                                                                                           monkeypatch):
    import dataclasses

    from pace_core.export import read_config
    from pace_core.shapes import load_shape

    shape = load_shape(env["model"])  # 4 layers, GDN layers 0, 1, 3
    twelve = dataclasses.replace(shape, num_layers=12, num_gdn_layers=9, gdn_layers=(0, 1, 3, 4, 5, 7, 8, 9, 11))
    files = {
        "fingerprint": (_file_for(tmp_path, "fingerprint", shape, "0" * 16), "calibrated on other weights"),
        "layers": (_file_for(tmp_path, "layers", twelve, None), "num_layers 12 in the file, 4 in the model"),
        "bits": (_file_for(tmp_path, "bits", shape, None, lambda d: d["pace"].update(bits=99)),
                 "pace.bits is not allowed"),
        "layout": (_file_for(tmp_path, "layout", shape, None, lambda d: d["state_layout"].update(groups_along="value")),
                   "state_layout.groups_along='value' contradicts"),
    }
    out = tmp_path / "out"
    small = ("--text", env["text"], "--max-tokens", "64", "--window", "32", "--out", str(out))
    for path, message in files.values():
        for argv in (("perplexity", *small, "--configs", "rtn-int8", path), ("drift", "--out", str(out), "--text",
                     env["text"], "--tokens", "32", "--configs", path), ("generate", "--out", str(out),
                     "--max-new-tokens", "2", "--configs", path), ("calibrate", "--out", str(out), "--config", path),
                     ("export", "--out", str(out), "--config", path, "--output", str(tmp_path / "exported.json"))):
            assert _run(env, *argv) == 2, argv
            err = capsys.readouterr().err
            assert err.startswith("error: ") and message in err and "Traceback" not in err, (argv, err)
    stored = [p.name for p in out.rglob("*") if p.is_file() and not p.name.startswith("model_card")]
    assert stored == [] and not (tmp_path / "exported.json").exists()
    # the same file made for this model and its weights runs, with its own heads
    [ctx] = [c for key, c in commands._CONTEXTS.items() if key[0] == env["model"]]
    mine = _file_for(tmp_path, "mine", shape, ctx.loaded.fingerprint)
    assert _run(env, "perplexity", *small, "--configs", mine) == 0
    [result] = [r for r in list_results(env["model"], "perplexity", root=str(out)).results
                if r.data["config"] == "pace-4-8"]
    assert result.provenance["config_hashes"] == {"pace-4-8": config_hash(read_config(mine).config)}
    # a file that disagrees with itself is refused before the model loads
    monkeypatch.setattr(commands, "_CONTEXTS", {})
    assert _run(env, "perplexity", *small, "--configs", files["bits"][0]) == 2 and commands._CONTEXTS == {}


def test_all_small(env, tmp_path, capsys, bars, monkeypatch):
    monkeypatch.setattr(commands, "_CONTEXTS", {})  # a fresh load: the card is stored with these results
    out = str(tmp_path / "all")
    argv = ["all", "--model", env["model"], "--out", out, "--quiet", "--configs", "rtn-int4", "pace-4-8", "damp-int4",
            "--calibration-text", env["text"], "--calibration-tokens", "64", "--sweep-tokens", "48",
            "--sweep-decode-tokens", "16", "--drift-tokens", "24", "--drift-every", "4", "--ppl-text", env["text"],
            "--ppl-tokens", "64", "--ppl-window", "32", "--max-new-tokens", "3"]
    assert main(argv) == 0
    _assert_filled(bars)
    assert {desc.split()[0] for desc, _ in bars} >= {"calibrate", "sweep", "drift", "perplexity", "generate", "claims"}
    kinds = sorted({r.kind for r in list_results(env["model"], root=out).results})
    assert kinds == ["calibration", "claims", "claims_quality", "compare", "drift", "generation", "model_card",
                     "perplexity", "structure", "sweep"]
    # compare: every named configuration, the perplexity step's results reused (the same settings)
    [cmp] = list_results(env["model"], "compare", root=out).results
    assert [p["config"] for p in cmp.data["points"]] == list(NAMED_CONFIGS)
    assert "reusing stored perplexity of fp32, rtn-int4, pace-4-8, damp-int4 (--force" in capsys.readouterr().out
    [claims] = list_results(env["model"], "claims", root=out).results
    assert {c["claim"] for c in claims.data["claims"]} == set("abcde")
    # the claims' perplexity is stored per configuration: a stopped run resumes, computing only what is missing
    quality = list_results(env["model"], "claims_quality", root=out).results
    reported = {row["label"]: row for row in claims.data["quality"]}
    assert len(quality) > 10 and {r.data["config"] for r in quality} <= set(reported)
    assert all(r.data["row"]["kl"] == reported[r.data["config"]]["kl"] for r in quality)  # the report's numbers
    claims.path.unlink()
    quality[0].path.unlink()
    capsys.readouterr()
    bars.clear()
    assert (
        main(
            [
                "claims",
                "--model",
                env["model"],
                "--out",
                out,
                "--quiet",
                "--text",
                env["text"],
                "--max-tokens",
                "64",
                "--window",
                "512",
                "--calibration-text",
                env["text"],
                "--calibration-tokens",
                "64",
            ]
        )
        == 0
    )
    _assert_filled(bars)  # the resumed run announces only the configuration it measures
    printed = capsys.readouterr().out
    assert "reusing stored claims_quality" in printed
    assert printed.count("saved") == 2  # the one configuration removed, then the report
    [again] = list_results(env["model"], "claims", root=out).results
    assert again.data["claims"] == claims.data["claims"]
    for kind in ("drift", "perplexity", "generation"):  # damp runs with its calibrated outlier rows everywhere
        [r] = result_sets(env["model"], kind, root=out).results
        assert "damp-int4" in set(r.table.config)
    exported = list((tmp_path / "all").glob("*/config-pace-4-8.json"))
    assert len(exported) == 1 and config_from_json(exported[0].read_text()).high_heads is not None


def test_structure_reports_the_fp32_state_after_the_prefill(env):
    from pace_core.analysis.structure import structure_stats
    from pace_core.analysis.text import read_text, tokenize
    from pace_core.config import get_config
    from pace_core.model.capture import run_with_states
    from pace_core.model.loading import load_model

    assert _run(env, "structure", "--text", env["text"], "--tokens", "96", "--threshold", "3") == 0
    [r] = list_results(env["model"], "structure", root=env["out"]).results
    loaded = load_model(env["model"])
    ids = tokenize(loaded.tokenizer, read_text(env["text"]), 96)
    states = run_with_states(loaded, get_config("fp32"), ids, capture_steps=[ids.shape[1]]).states[ids.shape[1]]
    assert len(r.table) == len(loaded.gdn_layers) * loaded.shape.num_v_heads
    for layer, S in states.items():  # independent recomputation from the captured state
        stats = structure_stats(S, 3.0)
        rows = r.table[r.table.layer == layer].sort_values("head")
        assert rows.col_ratio.tolist() == pytest.approx(stats.col_ratio.tolist(), rel=1e-12)
        assert rows.outlier_cols.tolist() == stats.outlier_cols.sum(-1).tolist()
    assert r.data["tokens"] == ids.shape[1] and r.data["threshold"] == 3.0


def test_a_damaged_stored_result_is_named_and_computed_again(env, capsys, tmp_path):
    out = str(tmp_path / "results")
    argv = ["perplexity", "--model", env["model"], "--out", out, "--quiet", "--text", env["text"], "--window", "32",
            "--stride", "16", "--max-tokens", "64", "--configs", "rtn-int8"]
    assert main(argv) == 0
    [fp32, int8] = result_sets(env["model"], "perplexity", root=out).results[0].results
    int8.path.write_text("{not json")
    capsys.readouterr()
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert f"damaged stored perplexity: {int8.path}: not a readable JSON result" in printed
    assert "reusing stored perplexity of fp32 " in printed and printed.count("saved") == 1
    listing = result_sets(env["model"], "perplexity", root=out)
    assert listing.damaged == [] and listing.results[0].rows("row")[1] == int8.data["row"]  # the same numbers


def test_results_of_another_method_version_are_not_reused(env, capsys, tmp_path, monkeypatch):
    import pace_core.version

    out = str(tmp_path / "results")
    argv = ["perplexity", "--model", env["model"], "--out", out, "--quiet", "--text", env["text"], "--window", "32",
            "--stride", "16", "--max-tokens", "64", "--configs", "rtn-int8"]
    assert main(argv) == 0
    capsys.readouterr()
    bumped = pace_core.version.METHOD_VERSION + 1  # the code changed its numbers: the version was bumped
    for module in (pace_core.version, pace_core.results):
        monkeypatch.setattr(module, "METHOD_VERSION", bumped)
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "reusing" not in printed and printed.count("saved") == 2
    current, stale = result_sets(env["model"], "perplexity", root=out).results
    assert not current.stale and stale.stale and current.params_key != stale.params_key
    assert stale.stale_label.startswith(f"stale: made by method version {bumped - 1} (code ")
    assert [r.provenance["method_version"] for r in current.results] == [bumped] * 2


def test_per_config_stores_each_group_as_it_finishes(env, capsys, tmp_path, monkeypatch):
    """A run stopped (Ctrl-C) after its first group keeps that group's results, exits 130 naming them and the
    command that resumes; the resumed run computes only the rest."""
    import pace_core.analysis.drift as analysis

    out = str(tmp_path / "results")
    monkeypatch.setattr(commands, "CONFIG_GROUP", 1)
    real, calls = analysis.drift, []

    def drift(*args, **kwargs):
        calls.append([c.name for c in args[1]])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(analysis, "drift", drift)
    argv = ["drift", "--model", env["model"], "--out", out, "--quiet", "--text", env["text"], "--tokens", "32",
            "--every", "4", "--configs", "rtn-int4", "rtn-int8"]
    monkeypatch.setattr(sys, "argv", [PACE_MAIN, *argv])  # as `python -m pace_core drift ...` sets it
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert calls == [["rtn-int4"], ["rtn-int8"]]
    assert (f"interrupted: stored 1 result(s): drift of rtn-int4. `python -m pace_core {' '.join(argv)}` resumes"
            in err)
    assert [r.data["config"] for r in list_results(env["model"], "drift", root=out).results] == ["rtn-int4"]
    assert main(argv) == 0
    assert calls[2:] == [["rtn-int8"]] and "reusing stored drift of rtn-int4" in capsys.readouterr().out


_STOPPED_RUN = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a terminal, also under a background job
import pace_core.analysis.drift as analysis
real, calls = analysis.drift, [0]
def drift(*args, **kwargs):
    calls[0] += 1
    if calls[0] == 2:
        print("ready", flush=True)
        time.sleep(120)
    return real(*args, **kwargs)
analysis.drift = drift
from pace_core.cli import main
sys.argv[0] = sys.argv.pop(1)  # the path of pace_core/__main__.py, as `python -m pace_core` sets it
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGINT"])
def test_a_stopped_run_keeps_its_finished_groups(env, tmp_path, sig):
    """A drift of five configurations (groups of four and one) killed, or interrupted by Ctrl-C, while the
    second group runs: the first group's four results are stored and read; Ctrl-C exits with 130 and says so."""
    import os
    import signal
    import subprocess

    out = str(tmp_path / "results")
    configs = ["rtn-int3", "rtn-int4", "rtn-int5", "rtn-int6", "rtn-int8"]
    argv = ["drift", "--model", env["model"], "--out", out, "--quiet", "--text", env["text"], "--tokens", "32",
            "--every", "4", "--configs", *configs]
    repo = str(Path(__file__).resolve().parents[1])
    proc = subprocess.Popen([sys.executable, "-c", _STOPPED_RUN, PACE_MAIN, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": repo})
    try:
        lines = []
        while not lines or lines[-1] != "ready":
            line = proc.stdout.readline()
            assert line, f"the run ended early: {proc.stderr.read()[-2000:]}"
            lines.append(line.strip())
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert sum(line.startswith("saved ") for line in lines) == commands.CONFIG_GROUP == 4
    if sig == "SIGINT":
        assert proc.returncode == 130
        assert ("interrupted: stored 4 result(s): drift of rtn-int3, drift of rtn-int4, drift of rtn-int5, drift of "
                f"rtn-int6. `python -m pace_core {' '.join(argv)}` resumes") in err
    else:
        assert proc.returncode == -signal.SIGKILL
    listing = list_results(env["model"], "drift", root=out)
    assert sorted(r.data["config"] for r in listing.results) == configs[:4] and listing.damaged == []
    assert not [p for p in Path(listing.results[0].path).parent.iterdir() if p.suffix == ".tmp"]


def test_export_never_silently_replaces_another_calibration(env, capsys, tmp_path):
    out = str(tmp_path / "results")
    argv = ["export", "--model", env["model"], "--out", out, "--quiet", "--text", env["text"], "--sample-every", "32"]
    assert main([*argv, "--tokens", "128"]) == 0
    [path] = list((tmp_path / "results").glob("*/config-pace-4-8.json"))
    first = path.read_bytes()
    capsys.readouterr()
    assert main([*argv, "--tokens", "128"]) == 0  # the same configuration and calibration: left as it is
    assert "already holds this configuration and calibration: left as it is" in capsys.readouterr().out
    assert path.read_bytes() == first
    assert main([*argv, "--tokens", "64"]) == 2  # another calibration: refused, naming the file and the difference
    err = capsys.readouterr().err
    assert f"error: {path} holds another configuration: calibration.tokens 128 in the file, 64 now" in err
    assert "--force replaces it" in err and path.read_bytes() == first
    assert main([*argv, "--tokens", "64", "--force"]) == 0
    assert config_from_json(path.read_text()) is not None and b'"calibration_tokens": 64' in path.read_bytes()
    assert export_differences(first, path.read_text())[0] == "calibration.tokens 128 in the file, 64 now"
    assert export_differences(b"[1]", path.read_text()) == ["it is not a configuration JSON (not an object)"]


def test_results_are_keyed_by_the_reference_another_clone_names(env, capsys, monkeypatch, tmp_path):
    """The embedded model given by its absolute path (this clone) and by its repository path (any clone): one key,
    so a fresh clone reuses the shipped results instead of computing them again."""
    from pace_core.results import REPO_ROOT

    monkeypatch.setattr(commands, "_CONTEXTS", {})
    out = str(tmp_path / "results")
    args = ["calibrate", "--out", out, "--quiet", "--text", env["text"], "--tokens", "64", "--sample-every", "32"]
    absolute = str(REPO_ROOT / "data" / "models" / "pace-tiny-qwen35")
    assert main([args[0], "--model", absolute, *args[1:]]) == 0
    assert "saved" in capsys.readouterr().out
    monkeypatch.chdir(REPO_ROOT)
    assert main([args[0], "--model", "data/models/pace-tiny-qwen35", *args[1:]]) == 0
    assert "saved" not in capsys.readouterr().out
