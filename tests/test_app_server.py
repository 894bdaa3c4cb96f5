"""The app as the README starts it (`streamlit run app.py --server.headless true --server.port PORT`): it
listens on the loopback interface only, its first page runs for a real session (a websocket client, as a
browser connects), and it makes no outbound network attempt on the way (tests/outbound/sitecustomize.py
records and refuses every one), nor when another site's page or a name rebound to the loopback tries its
websocket, which it refuses."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import tomllib
from app_support import REPO_ROOT, outbound_attempts, served_app

LISTEN = "0A"  # the TCP state LISTEN in /proc/net/tcp{,6}


def _listening(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net writes them) of the sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.rpartition(":")
            if state == LISTEN and int(hex_port, 16) == port:
                found.append(address)
    return found


def _first_page(base: str, query: str = "") -> list[tuple[str, str]]:
    """Run the first page for one session over the app's websocket, as a browser does: its (element type,
    text) of headings, markdown and alerts, until the script run finished (no exception allowed)."""
    from streamlit.proto.BackMsg_pb2 import BackMsg
    from streamlit.proto.ForwardMsg_pb2 import ForwardMsg
    from websockets.sync.client import connect

    shown = []
    with connect(base.replace("http", "ws") + "/_stcore/stream", subprotocols=["streamlit"], origin=base,
                 open_timeout=60) as ws:
        rerun = BackMsg()
        rerun.rerun_script.query_string = query
        ws.send(rerun.SerializeToString())
        while True:
            msg = ForwardMsg()
            msg.ParseFromString(ws.recv(timeout=300))
            kind = msg.WhichOneof("type")
            if kind == "script_finished":
                assert msg.script_finished == ForwardMsg.FINISHED_SUCCESSFULLY
                return shown
            if kind == "delta" and msg.delta.WhichOneof("type") == "new_element":
                element = msg.delta.new_element
                which = element.WhichOneof("type")
                assert which != "exception", element.exception.message
                if which in ("heading", "markdown", "alert"):
                    shown.append((which, getattr(element, which).body))


def test_local_by_default_listens_on_loopback_and_reaches_nothing_outside(tmp_path):
    settings = tomllib.loads((REPO_ROOT / ".streamlit" / "config.toml").read_text())
    assert settings["client"]["showErrorDetails"] == "none"  # a visitor sees no traceback or server path
    with served_app(tmp_path) as (base, _, outbound):
        page = urllib.request.urlopen(base + "/", timeout=30).read().decode()
        assert "<title>" in page.lower() or "<!doctype html>" in page.lower()
        port = int(base.rsplit(":", 1)[1])
        assert _listening(port) == ["0100007F"]  # 127.0.0.1 alone, no wildcard, no IPv6 socket
        shown = _first_page(base)
        assert ("heading", "PACE Studio") in shown
        # a link that names a server path is refused without saying whether it exists
        for model in ("/etc", "/no/such/folder"):
            alerts = [text for kind, text in _first_page(base, f"model={model}") if kind == "alert"]
            assert any("URL parameter 'model' is not allowed" in a for a in alerts)
            assert not any(model in a for a in alerts)
        assert outbound_attempts(outbound) == []
    assert "URL: http://127.0.0.1:" in (tmp_path / "streamlit.log").read_text()
    assert "Did not auto detect external IP" not in (tmp_path / "streamlit.log").read_text()


def _handshake(base: str, origin: str, host: str | None = None) -> int:
    """The HTTP status with which the app answers a websocket opened from a page of ``origin`` (as a browser opens
    it) under the name ``host`` (the Host header; default: the app's own address), the connection going to the
    app's loopback port either way: 101 when accepted."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        try:
            with connect(f"ws://{host or f'127.0.0.1:{port}'}/_stcore/stream", sock=sock, origin=origin,
                         subprotocols=["streamlit"], open_timeout=60):
                return 101
        except InvalidStatus as refused:
            return refused.response.status_code


def test_a_foreign_page_and_a_rebound_name_are_refused_without_reaching_outside(tmp_path):
    """A page of another site that opens the app's websocket (any page the user has open may) is refused with
    Streamlit's 403, and the server looks nothing up to decide it (before app_state.offline it connected to a
    public resolver's address and asked an external-IP service, on every attempt); a name an attacker's DNS
    rebinds to 127.0.0.1 is refused by server.allowedHosts (before: accepted, 101). The loopback's names are
    accepted. The look-ups are turned off by app.py, so from the app's first run on (opening the app runs it)."""
    settings = tomllib.loads((REPO_ROOT / ".streamlit" / "config.toml").read_text())
    assert settings["server"]["allowedHosts"] == ["localhost", "127.0.0.1"]
    with served_app(tmp_path) as (base, _, outbound):
        port = int(base.rsplit(":", 1)[1])
        rebound = f"evil.example:{port}"
        assert _handshake(base, f"http://{rebound}", rebound) == 403  # refused from the start: configuration
        assert ("heading", "PACE Studio") in _first_page(base)  # the user opens the app
        for origin in ("http://evil.example", "https://evil.example:8443", "null", f"http://{rebound}"):
            assert _handshake(base, origin) == 403, origin
        assert _handshake(base, f"http://{rebound}", rebound) == 403
        assert _handshake(base, base) == 101
        assert _handshake(base, f"http://localhost:{port}", f"localhost:{port}") == 101
        assert outbound_attempts(outbound) == []
