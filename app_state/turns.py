"""One computation at a time on a loaded model: the pages' first, the background warm-up between them.

One loaded model serves every session and thread of the app, but torch does not let two threads compute on one
GPU safely: what it sets up on first use can be set up by both at once. On an H100 the Head ranking page of a
Qwen3.5-4B-shaped model, computing its calibration while the warm-up (:mod:`app_state.warmup`) ran its own, failed
with "RuntimeError: lazy wrapper should be called at most once" (torch's CUDA linear algebra, loaded by the first
``solve_triangular``) and, in another run, with "TypeError: 'NoneType' object is not a mapping". So every
computation of the app on a model holds the model's turn (:class:`Turn`, one per model, :func:`of`):

- a page's computation (:meth:`Turn.page`) waits for it; the computations of several sessions run one after the
  other, and the thread that holds it may take it again (a calibration inside a drift run);
- a background step (:meth:`Turn.background`) takes it only while no page holds or waits for it, and runs with
  :meth:`Turn.yield_to_pages` as its progress callback: once a page asks for the turn, the step stops at its next
  progress unit (:class:`Yielded`, a core call of one GDN layer) and gives the turn up, so that a page waits for
  little more than one unit of background work.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import streamlit as st


class Yielded(Exception):
    """A background step stopped because a page asked for the turn (raised by :meth:`Turn.yield_to_pages`)."""


class Turn:
    """The turn to compute on one model (module docstring)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._holder: int | None = None  # the thread computing now
        self._depth = 0  # how often that thread took the turn
        self._background = False  # the holder runs a background step
        self._pages = 0  # page computations holding or waiting for the turn

    @contextmanager
    def page(self) -> Iterator[None]:
        """Hold the turn for a page's computation: wait while another thread holds it (a spinner says so when
        another page's computation runs; a background step gives it up at its next progress unit)."""
        me = threading.get_ident()
        with self._changed:
            self._pages += 1
            busy = self._holder not in (None, me) and not self._background
        try:
            if busy:
                with st.spinner("Waiting for another computation on this model to finish…"):
                    self._take(me)
            else:
                self._take(me)
            try:
                yield
            finally:
                self._give_back()
        finally:
            with self._changed:
                self._pages -= 1
                self._changed.notify_all()

    def _take(self, me: int) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._holder in (None, me))
            self._holder, self._depth = me, self._depth + 1

    def _give_back(self) -> None:
        with self._changed:
            self._depth -= 1
            if not self._depth:
                self._holder, self._background = None, False
            self._changed.notify_all()

    @contextmanager
    def background(self) -> Iterator[None]:
        """Hold the turn for one background step, taken once no page holds or waits for it. Pass
        :meth:`yield_to_pages` as the step's progress callback, and run the step again after :class:`Yielded`."""
        with self._changed:
            self._changed.wait_for(lambda: self._holder is None and not self._pages)
            self._holder, self._depth, self._background = threading.get_ident(), 1, True
        try:
            yield
        finally:
            self._give_back()

    def yield_to_pages(self, units: int = 0) -> None:
        """A background step's progress callback (``units`` done, unused): raises :class:`Yielded` once a page
        asks for the turn."""
        if self._pages:
            raise Yielded


_TURNS: weakref.WeakKeyDictionary[object, Turn] = weakref.WeakKeyDictionary()
_TURNS_LOCK = threading.Lock()


def of(model: object) -> Turn:
    """The turn of ``model`` (a loaded model's torch module, shared by every ``LoadedModel`` holding it)."""
    with _TURNS_LOCK:
        turn = _TURNS.get(model)
        if turn is None:
            turn = _TURNS[model] = Turn()
        return turn
