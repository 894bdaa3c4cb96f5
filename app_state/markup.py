"""Text the app did not write, shown as itself and never as markup: a URL's values, a configuration's or a model's
name, a path, an error message that quotes them, what a stored file holds.

Streamlit renders GitHub-flavoured Markdown with its own directives (colours, icons, emoji) and LaTeX in alerts,
captions, headings, ``st.markdown``, metric labels and values, widget labels, radio and select-slider options and
tooltips: a value echoed there could show a live link, make the browser fetch an image from another host or
restyle the page. Every such value goes through :func:`escape` (or :func:`code`, for inline code); tables
(``st.dataframe``), ``st.code``, ``st.json`` and select-box options show text as it is and take it unescaped.
Both also hide the server's paths in operator mode (:func:`app_state.controls.hide_paths`).
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

from app_state.controls import hide_paths

_SPECIAL = re.compile(r"([\\`*_\[\]<>&$~|:@#!{}])")
"""What starts a construct wherever it stands: emphasis, code, links and images (``[``), raw HTML and autolinks
(``<``), entities (``&``), LaTeX (``$``), strikethrough, tables, Streamlit's directives (``:red[…]``,
``:material/…:``, emoji ``:smile:``) and literal autolinks (``http://``: the ``:``; e-mail: the ``@``)."""
_JOINER = "\u2060"
"""WORD JOINER, invisible: Streamlit also rewrites the text of a parsed document (the escapes already undone), so a
joiner breaks the patterns it looks for there without changing what the reader sees."""
_REWRITTEN = re.compile(r"(?<=:)(?=\S)|(?i:(?<=www)(?=\.))|(?<=@)(?=\w)|(?<=<)(?=[-=])|(?<=-)(?=[->])|(?<=[>~])(?==)")
"""Where :data:`_JOINER` goes: after a ``:`` that a word or ``//`` follows (``http://`` autolinks, ``:material/…:``
and ``:streamlit:`` icons, emoji shortcodes), inside ``www.`` and after an ``@`` that a word follows (autolinks,
e-mail links), and inside the arrows and signs Streamlit turns into typography (``->``, ``<-``, ``--``, ``>=``,
``<=``, ``~=``)."""
_ICON = re.compile(r"(?<=:)(?=material/)")
"""Where :data:`_JOINER` goes in inline code: Streamlit turns ``:material/`` into an icon before it parses, code
spans included."""
_LINE_START = (re.compile(r"^(\s*)([-+=])"), re.compile(r"^(\s*\d+)([.)])"))
"""What starts a block only at the start of a line: a list item (``-``, ``+``, ``1.``, ``1)``), a setext
underline."""


def _printable(value: Any) -> str:
    """``value`` as one line of text: line breaks and tabs as spaces, other control and format characters (a
    right-to-left override, a zero-width space) as their ``\\uXXXX`` escape, so they show."""
    out = []
    for ch in str(value):
        if ch in "\r\n\t\v\f\u2028\u2029":
            out.append(" ")
        elif unicodedata.category(ch) in ("Cc", "Cf", "Co", "Cs"):
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out)


def escape(value: Any) -> str:
    """``value`` as literal text in Streamlit's Markdown: every character that could start a construct escaped
    with a backslash (CommonMark shows an escaped punctuation character as itself), an invisible joiner where
    Streamlit would rewrite the parsed text (:data:`_REWRITTEN`), on one line, server paths hidden in operator
    mode."""
    text = _REWRITTEN.sub(_JOINER, _printable(hide_paths(str(value))))
    text = _SPECIAL.sub(r"\\\1", text)
    for start in _LINE_START:
        text = start.sub(r"\1\\\2", text, count=1)
    return text


def code(value: Any) -> str:
    """``value`` as inline code (nothing inside a code span is markup): fenced by one more backtick than its
    longest run of backticks, on one line, server paths hidden in operator mode."""
    text = _ICON.sub(_JOINER, _printable(hide_paths(str(value))))
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    if text.startswith("`") or text.endswith("`") or (text.startswith(" ") and text.endswith(" ") and text.strip()):
        text = f" {text} "  # a space each side, which the code span strips again
    return f"{fence}{text}{fence}"
