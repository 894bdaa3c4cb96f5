"""app_state.markup: what the app echoes (a URL's values, names, paths, error messages) is literal text in
Streamlit's Markdown, and in operator mode no server path. The rendering itself is checked in Chromium by
tests/test_browser.py (test_a_link_and_a_file_show_their_values_as_text)."""

from __future__ import annotations

import re
import string

from app_support import plain
from hypothesis import given, settings
from hypothesis import strategies as hs

from app_state import controls
from app_state.markup import code, escape

HOSTILE = ["![i](http://evil.example/i.png)", "[Fix this](http://evil.example/a)", "<img src=http://evil.example/x>",
           "http://evil.example/a", "HTTPS://evil.example", "www.evil.example", "WWW.Evil.example", "a@evil.example",
           "<https://evil.example>", "**b** _i_ ~~s~~ `c`", ":red[x] :material/home: :smile: :streamlit:", "$x^2$",
           "# h", "> q", "- l", "+ l", "1. l", "2) l", "&lt;&#x202E;", "[r]: http://evil.example", "a | b",
           "a -> b <- c <-> d -- e >= f <= g ~= h", "\\", "\\*", "line\nbreak\r\ttab", "rtl\u202eltr", "bell\x07",
           "zero\u200bwidth"]
"""Values that would be markup, a link, an image or a rewrite if echoed as they are."""

LITERAL = re.compile(r"\\[!-/:-@\[-`{-~]")
"""A backslash escape of an ASCII punctuation character: shown as that character."""


def _shown(value: str) -> str:
    """What a reader should see of ``value``: the value on one line, control and format characters as escapes."""
    out = []
    for ch in value:
        if ch in "\r\n\t":
            out.append(" ")
        elif ch in "\u202e\x07\u200b":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out)


def test_every_construct_is_escaped_and_reads_as_the_value():
    for value in HOSTILE:
        md = escape(value)
        assert plain(md) == _shown(value), value
        bare = LITERAL.sub("", md).replace("\u2060", "")
        # nothing that starts a construct stays unescaped: brackets, angle brackets, emphasis, code, entities, math,
        # directives, autolinks (':' of a scheme, '@' of an address, the dot of 'www.')
        assert not set(bare) & set("[]<>*_`&$~|:@#!{}\\"), (value, md)
        assert not re.search(r"(?i)https?://|www\.|@\w|(^|\s)(->|<-|--|>=|<=|~=)(\s|$)", md.replace("\\", "")), md
        assert "\n" not in md and "\r" not in md
    assert escape("- item").startswith("\\-") and escape("12. item").startswith("12\\.")


@settings(max_examples=300, deadline=None)
@given(hs.text(alphabet=hs.sampled_from(string.printable + "\u202e\u2028é漢"), max_size=40))
def test_any_text_reads_as_itself(value):
    md = escape(value)
    assert "\n" not in md
    shown = plain(md)
    want = value.translate({ord(c): " " for c in "\r\n\t\x0b\x0c\u2028"}).replace("\u202e", "\\u202e")
    assert shown == want


def test_code_spans_hold_any_backticks_and_no_icon():
    for value in ("python -m pace_core perplexity --configs x.json", "a`b", "``x``", "`", ":material/home:"):
        md = code(value)
        fence = re.match(r"`+", md).group(0)
        inner = md[len(fence):-len(fence)]
        assert md.endswith(fence) and fence not in inner and not inner.startswith("`") and not inner.endswith("`")
        assert (inner[1:-1] if inner.startswith(" ") and inner.endswith(" ") else inner).replace("\u2060", "") == value
        assert ":material/" not in md


def test_operator_mode_hides_server_paths(tmp_path, monkeypatch):
    folder = tmp_path / "models"
    (folder / "qwen").mkdir(parents=True)
    message = (f"Could not load model '{folder}/qwen': {folder}/qwen/config.json is not valid JSON. The cache "
               f"/root/.cache/huggingface/hub holds nothing; see {controls.REPO_ROOT}/README.md.")
    monkeypatch.delenv(controls.MODELS_DIR_ENV, raising=False)
    assert controls.hide_paths(message) == message  # the local user's own machine: their paths as they are
    monkeypatch.setenv(controls.MODELS_DIR_ENV, str(folder))
    hidden = controls.hide_paths(message)
    assert hidden == ("Could not load model 'qwen': qwen/config.json is not valid JSON. The cache <server path> "
                      "holds nothing; see README.md.")
    for shown in (plain(escape(message)), code(message)):
        assert str(tmp_path) not in shown and str(controls.REPO_ROOT) not in shown and "/root" not in shown
    for text in ("Qwen/Qwen3.5-4B", "http://host/a/b", "bits/value", "1/2", "S [HV, K, V]"):
        assert controls.hide_paths(text) == text
