"""pace_core.names: a configuration's name from outside follows one short printable rule, checked where every
document is read (pace_core.export.read_config): the app's import, the CLI's --config / --configs, apply."""

import json

import pytest

from pace_core import cli
from pace_core.cli.context import _read_configs
from pace_core.config import NAMED_CONFIGS, get_config
from pace_core.errors import PaceError
from pace_core.export import admit, config_to_dict, export_document, export_filename, export_json, read_config
from pace_core.names import MAX_NAME_LENGTH, NAME_RULE, check_name
from pace_core.shapes import BUILTIN_SHAPES

HOSTILE = ["![i](http://evil.example/i.png)", "[Fix this](http://evil.example)", "<img src=x>", "../../etc/passwd",
           "/etc/passwd", "a\nb", "tab\there", "bell\x07", "right\u202eleft", "x" * (MAX_NAME_LENGTH + 1),
           "x" * 100_000, "", " pace-4", "pace-4 ", "-leading-dash", ".hidden", "my config", "naïve", "a:b",
           "**bold**", "`code`", "$x$"]
GOOD = ["pace-4", "pace-4-8", "fp32", "my-config_v2", "A.b+c", "x" * MAX_NAME_LENGTH, "0"]


def test_the_rule_takes_short_printable_words_only():
    for name in GOOD:
        assert check_name(name) == name
    for name in [*HOSTILE, None, 3, ["pace-4"]]:
        with pytest.raises(PaceError, match="the field pace.name=.* is not allowed; allowed: a configuration name of"):
            check_name(name)
    assert all(check_name(name) == name for name in NAMED_CONFIGS)  # the project's own names follow it
    with pytest.raises(PaceError) as err:
        check_name("x" * 100_000)
    assert len(str(err.value)) < 400 and "100,000 characters" in str(err.value)  # a long name is not echoed whole


def _forms(name: str, tmp_path) -> list:
    """One configuration named ``name`` as each form a document arrives in: an export and a complete record, as
    a parsed object, JSON text and a file."""
    cfg = get_config("rtn-int5").replace(name=name)
    export = export_document(cfg, shape=BUILTIN_SHAPES["qwen3.5-27b"])
    record = config_to_dict(cfg)
    path = tmp_path / "named.json"
    path.write_text(json.dumps(export), encoding="utf-8")
    return [export, record, json.dumps(export), json.dumps(record), path, str(path)]


@pytest.mark.parametrize("name", HOSTILE[:8])
def test_every_document_read_checks_its_name(name, tmp_path):
    """Before: any string was accepted and stored (read_config returned it)."""
    for form in _forms(name, tmp_path):
        with pytest.raises(PaceError, match="is not allowed; allowed: a configuration name of"):
            read_config(form)
        with pytest.raises(PaceError, match="is not allowed; allowed: a configuration name of"):
            admit(form, BUILTIN_SHAPES["qwen3.5-27b"], ready_for="settings")
    for form in _forms("my-config_v2", tmp_path):
        assert admit(form, BUILTIN_SHAPES["qwen3.5-27b"], ready_for="settings").name == "my-config_v2"


def test_the_cli_refuses_a_file_with_such_a_name(tmp_path, capsys):
    """--configs files are read before the model loads (cli.context._read_configs) and --config by `bits`."""
    path = tmp_path / "hostile.json"
    path.write_text(export_json(get_config("pace-4").replace(name="![i](http://evil.example/i.png)")))
    with pytest.raises(PaceError, match="pace.name="):
        _read_configs([str(path)])
    assert cli.main(["bits", "--config", str(path), "--model", "qwen3.5-27b"]) == 2
    err = capsys.readouterr().err
    assert "error: the field pace.name=" in err and NAME_RULE in err


def test_a_configuration_made_in_code_keeps_its_own_label():
    """The code's own labels (a claim's 'pace-4-8 (bf16 buffer)', a drift curve's '4-bit dP8') are PaceConfigs,
    not documents read from outside: admitted as they are; the file name stays file-system safe."""
    cfg = get_config("pace-4").replace(name="pace-4 (bf16 buffer)")
    assert admit(cfg, ready_for="settings").name == "pace-4 (bf16 buffer)"
    assert export_filename(cfg) == "pace-4-bf16-buffer.json"
