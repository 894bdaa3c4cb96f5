"""The app as the README starts it (`streamlit run app.py --server.headless true --server.port PORT`): it
listens on the loopback interface only, its first page runs for a real session (a websocket client, as a
browser connects), and it makes no outbound network attempt on the way (tests/outbound/sitecustomize.py
records and refuses every one)."""

from __future__ import annotations

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
