"""The rule for the name of a configuration that arrives from outside (a file, JSON text or a parsed document:
the app's import, the CLI's ``--config`` / ``--configs``, ``pace_core.apply``, the vLLM plugin), checked where
such a document is read (:func:`pace_core.export.read_config`, so every caller of
:func:`pace_core.export.admit`).

A name is shown by the app, stored in results and used as a file name (``export_filename``): it is a short
printable word, :data:`NAME_RULE`, so it can be no path, markup, control character or page of text. The names
the code gives its own configurations (named configurations, a sweep's or a claim's labels) are not checked here.
"""

from __future__ import annotations

import re
from typing import Any

from pace_core.errors import PaceError

MAX_NAME_LENGTH = 64
NAME_PATTERN = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._+-]{{0,{MAX_NAME_LENGTH - 1}}}")
NAME_RULE = (f"1 to {MAX_NAME_LENGTH} characters: ASCII letters, digits, '.', '_', '+' and '-', starting with a "
             "letter or a digit")
"""What :data:`NAME_PATTERN` allows, in words (the error says it)."""


def check_name(name: Any, field: str = "pace.name") -> str:
    """``name`` when it follows :data:`NAME_RULE`, else PaceError naming ``field``, the rule and what to do."""
    if isinstance(name, str) and NAME_PATTERN.fullmatch(name):
        return name
    long = isinstance(name, str) and len(name) > 80
    shown = f"{name[:60]!r}… ({len(name):,} characters)" if long else repr(name)
    raise PaceError(f"the field {field}={shown} is not allowed; allowed: a configuration name of {NAME_RULE} "
                    "(e.g. pace-4-8 or my-config_v2). Rename the configuration and export it again")
