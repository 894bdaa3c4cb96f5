"""Loaded by any Python started with this folder on PYTHONPATH (tests/test_app_local.py): every outbound
network attempt (a name resolved, a connection or datagram to an address other than the loopback) is
appended as a JSON line to the file $PACE_OUTBOUND_LOG and refused, so a test sees what the process tried to
reach without depending on whether the host has a network."""

import errno
import ipaddress
import json
import os
import socket
import traceback

_LOG = os.environ.get("PACE_OUTBOUND_LOG")


def _loopback(host) -> bool:
    if host in (None, "", "localhost", b"localhost"):
        return True
    if isinstance(host, bytes):
        host = host.decode()
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
    except ValueError:
        return False  # a host name other than localhost


def _refuse(what: str, target) -> None:
    with open(_LOG, "a", encoding="utf-8") as f:
        f.write(json.dumps({"pid": os.getpid(), "call": what, "target": repr(target),
                            "stack": traceback.format_stack(limit=8)[:-2]}) + "\n")
    raise OSError(errno.ENETUNREACH, f"outbound network refused by the test ({what} {target!r})")


def _wrap_connect(name: str):
    real = getattr(socket.socket, name)

    def wrapped(self, address, *args):
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _loopback(address[0]):
            _refuse(name, address)
        return real(self, address, *args)

    setattr(socket.socket, name, wrapped)


def _wrap_sendto() -> None:
    real = socket.socket.sendto

    def sendto(self, data, *args):
        address = args[-1]
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _loopback(address[0]):
            _refuse("sendto", address)
        return real(self, data, *args)

    socket.socket.sendto = sendto


def _wrap_getaddrinfo() -> None:
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        if not _loopback(host):
            _refuse("getaddrinfo", host)
        return real(host, *args, **kwargs)

    socket.getaddrinfo = getaddrinfo


if _LOG:
    for _name in ("connect", "connect_ex"):
        _wrap_connect(_name)
    _wrap_sendto()
    _wrap_getaddrinfo()
