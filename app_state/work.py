"""Work that outlives a rerun: results kept per configuration (so adding or changing one configuration
computes only that one), and a progress bar with the time left and a Stop button for everything slower
than a second.

Results live in :func:`kept` (``st.cache_resource``: shared by the sessions of this server, tensors
kept as they are, on their device); a computation runs outside any ``st.cache_*`` function so its bar
and button are live widgets. Stop asks streamlit for a rerun, which interrupts the running script at its
next progress update; the rerun then shows that the work was stopped instead of starting it again, and
what was finished before (other configurations, the reference) stays kept.

Every computation runs with as many torch intra-op threads as cores that nothing else keeps busy
(:func:`use_free_cores`), chosen when it starts and again at each of its progress updates, so a program that
starts or stops on the host meanwhile is followed within a sampling window (pace_core.host).
"""

from __future__ import annotations

import functools
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any

import streamlit as st
import torch

from app_state.markup import escape
from pace_core.host import free_threads

_STOPPED = "_work_stopped"


class Kept:
    """A bounded mapping of computed results (least recently used dropped first)."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._items: OrderedDict[Hashable, Any] = OrderedDict()

    def get(self, key: Hashable) -> Any | None:
        if key not in self._items:
            return None
        self._items.move_to_end(key)
        return self._items[key]

    def put(self, key: Hashable, value: Any) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)


@st.cache_resource(show_spinner=False)
def _all_kept() -> dict[str, Kept]:
    return {}


def kept(kind: str, max_entries: int = 256) -> Kept:
    """The results kept for ``kind`` (one store per kind for the life of the server)."""
    return _all_kept().setdefault(kind, Kept(max_entries))


def per_config(kind: str, setting: Hashable, configs: tuple[tuple[str, str], ...],
               compute: Callable[[dict[str, str]], dict[str, Any]], *, max_entries: int = 256) -> dict[str, Any]:
    """``{label: result}`` for (label, config JSON) pairs under one ``setting``: each result is kept under
    (setting, config JSON), the missing ones computed together by ``compute({label: config JSON})``."""
    store = kept(kind, max_entries)
    found = {label: store.get((setting, text)) for label, text in configs}
    missing = {label: text for label, text in configs if found[label] is None}
    if missing:
        for label, value in compute(missing).items():
            store.put((setting, missing[label]), value)
            found[label] = value
    return found


@functools.cache
def default_threads() -> int:
    """torch's intra-op threads before the app's first computation (its own choice for this host, or what the
    process set before): what a quiet host gets."""
    return torch.get_num_threads()


def use_free_cores() -> int:
    """Set this thread's torch intra-op threads to the cores that nothing else keeps busy now
    (pace_core.host.free_threads: a thread on a busy core makes every operator wait for it); returns the count."""
    threads = free_threads(default_threads())
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return threads


def _eta(seconds: float) -> str:
    return f"about {seconds:.0f} s left" if seconds < 90 else f"about {seconds / 60:.0f} min left"


PROGRESS_EVERY_S = 0.25
"""The bar is redrawn at most this often (and at the end): each redraw is a message to the browser, and a
generation advances once per configuration, layer and token."""


@contextmanager
def progress(total: int, text: str, work: Hashable) -> Iterator[Callable[[int], None]]:
    """A progress bar of ``total`` units with the time left and a Stop button; yields ``advance(n)``.

    ``work`` names this computation (its inputs): once stopped, the same work is not started again on the
    following reruns; the page shows that it was stopped and a button that runs it. The computation's intra-op
    threads are chosen at the start and at every ``advance`` (:func:`use_free_cores`). ``text`` is shown as it
    is (:func:`app_state.markup.escape`), never as Markdown."""
    text = escape(text)
    stopped, name = st.session_state.get(_STOPPED), f"{hash(work) & 0xFFFFFFFF:08x}"
    if stopped == work:
        st.info(f"Stopped: {text}. What was finished before is kept.", icon=":material/stop_circle:")
        st.button(
            "Run it", key=f"work_resume_{name}", type="primary", on_click=st.session_state.pop, args=(_STOPPED, None)
        )
        st.stop()
    st.session_state.pop(_STOPPED, None)  # other work starts: a stop of earlier work is forgotten
    box = st.empty()
    with box.container():
        bar = st.progress(0.0, text=text)
        st.button("Stop", key=f"work_stop_{name}", on_click=st.session_state.__setitem__, args=(_STOPPED, work),
                  help="Stops this computation at its next step; the page then waits until you run it again.")
    done, start, shown = [0], time.monotonic(), [0.0]
    use_free_cores()

    def advance(n: int) -> None:
        use_free_cores()
        done[0] += n
        now = time.monotonic()
        if now - shown[0] < PROGRESS_EVERY_S and done[0] < total:
            return
        shown[0] = now
        share = min(done[0] / total, 1.0) if total else 1.0
        left = (now - start) * (1 - share) / share if share else 0.0
        bar.progress(share, text=f"{text} ({done[0]}/{total}, {_eta(left)})")

    try:
        yield advance
    finally:
        box.empty()
