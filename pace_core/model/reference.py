"""Where a model comes from, as text: a local folder or a hub id (:func:`looks_like_path`), and the reference results
and exports record (:func:`portable_reference`). Apart from :mod:`pace_core.model.loading`, so that naming a model
imports no model code."""

from __future__ import annotations

import os
from pathlib import Path

from pace_core.version import REPO_ROOT


def looks_like_path(source: str) -> bool:
    """A hub id is ``name`` or ``owner/name``; anything else (absolute, relative with ./ or ~,
    deeper than one slash, or an existing file system entry) is a local path."""
    return (
        os.path.isabs(source)
        or source.startswith((".", "~"))
        or source.count("/") > 1
        or source.endswith(("/", os.sep))
        or Path(source).exists()
    )


def portable_reference(source: str) -> str:
    """``source`` as another machine can follow it: a folder inside this repository by its path relative to the
    repository root (the embedded model: ``data/models/pace-tiny-qwen35``), a hub id or a folder elsewhere
    as given (never this machine's absolute path of a repository folder)."""
    if not looks_like_path(source):
        return source
    try:
        return Path(source).expanduser().resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:  # outside the repository: the user's own reference
        return source
