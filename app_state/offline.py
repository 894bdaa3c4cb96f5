"""The server reaches nothing outside the host, whatever a browser sends it.

A WebSocket whose Origin is not the page it came from (any site the user has open may try
``ws://127.0.0.1:8501/_stcore/stream``) is refused by Streamlit, but only after it has compared the Origin with this
host's addresses, which it looks up on every such attempt: a datagram socket "connected" to a public resolver
(``streamlit.net_util.get_internal_ip``) and an HTTP request to an external-IP service (``get_external_ip``). No
configuration option skips them (``server.address`` only skips the start-up banner's look-up). The app listens on
the loopback interface, where a browser reaches it as ``localhost`` or ``127.0.0.1``, which Streamlit accepts before
it looks anything up: :func:`no_address_lookups` makes both look-ups answer "no such address" without asking.
"""

from __future__ import annotations

from streamlit import net_util


def _no_address() -> None:
    """This host's network address, as the app answers it: none (it listens on the loopback only)."""
    return None


def no_address_lookups() -> None:
    """Replace Streamlit's look-ups of this host's internal and external addresses by :func:`_no_address` (for the
    server's process: the WebSocket Origin check calls them through the module). Called by app.py on every run;
    the first run of a session makes it hold for every later connection."""
    net_util.get_internal_ip = _no_address
    net_util.get_external_ip = _no_address
