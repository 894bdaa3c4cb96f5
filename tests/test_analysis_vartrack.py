"""The synthetic variable-tracking tasks: items checked against an independent reading of their text (the
assignments followed from the value asked about), their length in the model's tokens, seeding, the files lm-eval
reads."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from app_support import EMBEDDED_DIR
from transformers import AutoTokenizer

from pace_core.analysis import vartrack
from pace_core.analysis.vartrack import VarTrack, generate, make_item, parse_name, process_results, write_task
from pace_core.errors import PaceError


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(EMBEDDED_DIR)


def _holders(text: str) -> dict[str, set[str]]:
    """An independent reading of an item: every value and the variables that hold it, by following the text's
    assignments in order (``VAR X = 12345``, ``VAR Y = VAR X``)."""
    value_of: dict[str, str] = {}
    for target, source in re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|[0-9]{5})", text):
        value_of[target] = value_of[source[4:]] if source.startswith("VAR ") else source
    holders: dict[str, set[str]] = {}
    for var, value in value_of.items():
        holders.setdefault(value, set()).add(var)
    return holders


def test_names_ask_for_a_generation_or_a_multiple_choice_task_at_a_length():
    assert parse_name("pace_vt_4096") == VarTrack(4096)
    assert parse_name("pace_vt_mc_32k", samples=7, seed=3) == VarTrack(32768, choice=True, samples=7, seed=3)
    assert parse_name("pace_vt_mc_32k").name == "pace_vt_mc_32768" and parse_name("gsm8k") is None
    assert VarTrack(100).n_chains == 1 and VarTrack(100, choice=True).n_chains == 4
    for bad in (dict(length=10), dict(length=100, samples=0), dict(length=100, choice=True, chains=1)):
        with pytest.raises(PaceError, match="is not allowed"):
            VarTrack(**bad)


@pytest.mark.parametrize("choice", [False, True])
def test_items_are_rulers_chains_at_the_asked_length_in_the_models_tokens(tokenizer, choice):
    task = VarTrack(900, choice=choice, samples=6, seed=11)
    room = vartrack.answer_room(task, tokenizer)
    assert room == (vartrack.GEN_TOKENS if not choice else 1)  # the option letters are one token each here
    items = generate(task, tokenizer)
    for item in items:
        text = item["input"]
        assert item["tokens"] == len(tokenizer(text)["input_ids"])
        assert item["tokens"] + room <= task.length  # fits ...
        longer = make_item(task, item["index"], item["noises"] + 1)["input"]
        assert len(tokenizer(longer)["input_ids"]) + room > task.length  # ... and is the longest that does
        assert text.startswith("Memorize and track the chain(s) of variable assignment hidden in the following text.")
        assert text.count(vartrack.NOISE.strip()) == item["noises"]
        holders = _holders(text)
        assert len(holders) == task.n_chains and all(len(v) == task.hops + 1 for v in holders.values())
        assert holders[item["query"]] == set(item["outputs"])  # the answer RULER scores
        if choice:  # one option per chain, the right one holds the value asked about
            assert text.endswith("Answer:") and item["choices"] == ["A", "B", "C", "D"]
            owner = {var: value for value, vs in holders.items() for var in vs}
            assert [owner[v] == item["query"] for v in item["options"]] == [i == item["answer"] for i in range(4)]
            assert len({owner[v] for v in item["options"]}) == 4
        else:
            assert text.endswith(f"{task.hops + 1} variables are assgined the value {item['query']}, they are: ")
    assert len({i["input"] for i in items}) == len(items)


def test_items_are_seeded_per_index(tokenizer):
    few, more = (generate(VarTrack(700, choice=True, samples=n, seed=5), tokenizer) for n in (2, 4))
    assert more[:2] == few  # a prefix of the items is the same at any sample count
    assert generate(VarTrack(700, choice=True, samples=2, seed=6), tokenizer) != few


def test_a_length_too_short_for_an_item_is_refused(tokenizer):
    with pytest.raises(PaceError, match="tokens are too few"):
        generate(VarTrack(300, choice=True, samples=2), tokenizer)


def test_rulers_string_match_all():
    doc = {"outputs": ["ABCDE", "FGHIJ", "KLMNO", "PQRST"]}
    assert process_results(doc, ["abcde, FGHIJ and VAR KLMNO"]) == {"string_match_all": 0.75}
    assert process_results(doc, ["nothing"]) == {"string_match_all": 0.0}


class _Loader(yaml.SafeLoader):
    """YAML with lm-eval's ``!function`` tag read as its text."""


_Loader.add_constructor("!function", lambda loader, node: f"!function {loader.construct_scalar(node)}")


@pytest.mark.parametrize("choice", [False, True])
def test_write_task_writes_the_items_and_the_config_lm_eval_reads(tmp_path, tokenizer, choice):
    task = VarTrack(800, choice=choice, samples=3)
    files = write_task(task, tokenizer, tmp_path)
    config = yaml.load(files.config.read_text(), Loader=_Loader)
    assert config["task"] == task.name and config["dataset_kwargs"]["data_files"]["test"] == str(files.data.resolve())
    assert config["output_type"] == ("multiple_choice" if choice else "generate_until")
    assert config["metadata"]["version"] == vartrack.VT_VERSION and config["metadata"]["length"] == 800
    items = [json.loads(line) for line in files.data.read_text().splitlines()]
    assert items == generate(task, tokenizer)
    assert files.tokens == (min(i["tokens"] for i in items), max(i["tokens"] for i in items))
    assert (tmp_path / f"{vartrack.UTILS_MODULE}.py").exists() != choice
    if not choice:
        assert config["process_results"] == f"!function {vartrack.UTILS_MODULE}.process_results"
        assert config["generation_kwargs"] == {"do_sample": False, "temperature": 0.0, "max_gen_toks": 30, "until": []}
