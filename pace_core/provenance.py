"""What made a number: the command that ran, the code, the date, the host and the libraries' versions.

:func:`measurement` is the provenance a benchmark or measurement script saves beside its figures (under
``data/bench/``; a script adds its own settings to it, never rebuilds these fields). A stored result's provenance
(:func:`pace_core.results.make_provenance`) takes its command, code, date and versions from here too.
:func:`code_label` names the code of either in one line.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from pace_core._version import __version__
from pace_core.version import REPO_ROOT, code_commit

CPUINFO = Path("/proc/cpuinfo")


def invocation() -> str:
    """This process's command line as another machine would type it, without this machine's paths: a module of the
    repository run with ``-m`` as ``python -m <module>``, a script of the repository by its path from the
    repository's root, any other program (``pace``, ``streamlit``, ``pytest``) by its name."""
    if not sys.argv or not sys.argv[0]:
        return "python"
    path = Path(sys.argv[0]).resolve()
    try:
        rel = path.relative_to(REPO_ROOT)
    except ValueError:
        rel = None
    if rel is None:
        program = ("python " if path.suffix == ".py" else "") + path.name
    elif path.suffix != ".py":
        program = path.name
    elif rel.parts[0] == "pace_core":
        parts = rel.with_suffix("").parts
        program = "python -m " + ".".join(parts[:-1] if parts[-1] == "__main__" else parts)
    else:
        program = f"python {rel.as_posix()}"
    return " ".join([program, *sys.argv[1:]])


def utc_date() -> str:
    """Now, in UTC, to the second (ISO 8601: ``2026-12-06T21:35:46+00:00``)."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def versions() -> dict[str, str | None]:
    """Versions of pace_core, Python, torch, the CUDA torch was built for (None: a CPU build) and transformers
    (its installed distribution's, read without importing it: importing pace_core stays free of transformers)."""
    return {
        "pace_core": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": metadata.version("transformers"),
    }


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; where it has none, what :func:`platform.processor` says)."""
    try:
        for line in CPUINFO.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def gpus() -> list[str]:
    """The names of the CUDA devices this process sees (none without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def measurement() -> dict[str, Any]:
    """A measurement's provenance: ``command`` (:func:`invocation`), ``code`` (:func:`pace_core.version.code_commit`:
    ``{"commit", "dirty"}``, None outside a checkout), ``date`` (:func:`utc_date`), ``host``, ``cpu`` (its model),
    ``cpu_count``, the :func:`versions` (``pace_core``, ``python``, ``torch``, ``cuda``, ``transformers``) and
    ``gpus`` (the visible CUDA devices' names)."""
    return {"command": invocation(), "code": code_commit(), "date": utc_date(), "host": platform.node(),
            "cpu": cpu_model(), "cpu_count": os.cpu_count(), **versions(), "gpus": gpus()}


def code_label(provenance: dict[str, Any]) -> str:
    """The code that made a number, from its provenance: its commit's first 12 hex digits, ``with uncommitted
    changes`` when its files differed from that commit (``unknown`` when no commit was recorded). Reads ``code``
    (:func:`measurement`, a stored result's provenance) and the ``commit`` and ``worktree_dirty`` of benchmark files
    written before it."""
    code = provenance.get("code") or {"commit": provenance.get("commit"), "dirty": provenance.get("worktree_dirty")}
    return str(code.get("commit") or "unknown")[:12] + (" with uncommitted changes" if code.get("dirty") else "")
