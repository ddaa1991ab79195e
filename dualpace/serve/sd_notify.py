"""The systemd notification protocol (sd_notify(3)), written out: no libsystemd.

A unit with Type=notify starts the daemon with $NOTIFY_SOCKET naming a Unix
datagram socket; each notification is one datagram of newline-separated
KEY=VALUE lines. Outside systemd the variable is unset and every call here does
nothing, so daemons call these unconditionally:

    notifier = Notifier.from_environ()
    notifier.status("loading model")
    ...
    notifier.ready("serving on 127.0.0.1:50051")
    interval_s = watchdog_interval_s()      # None unless WatchdogSec= is set
    notifier.watchdog()                     # every interval_s while healthy
    notifier.stopping()

A socket path starting with '@' is in the Linux abstract namespace (the '@'
stands for a leading NUL byte). Sending never raises: a manager that went away
must not take the daemon down with it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Mapping

log = logging.getLogger(__name__)

NOTIFY_SOCKET = "NOTIFY_SOCKET"
WATCHDOG_USEC = "WATCHDOG_USEC"
WATCHDOG_PID = "WATCHDOG_PID"


def socket_address(value: str | None) -> str | bytes | None:
    """The address to send to for a $NOTIFY_SOCKET value; None when unset or unsupported."""
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + value[1:].encode()  # abstract namespace
    if value.startswith("/"):
        return value
    log.debug("ignoring NOTIFY_SOCKET=%r: only Unix socket paths are supported", value)
    return None


def watchdog_interval_s(environ: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """How often to send WATCHDOG=1: half of $WATCHDOG_USEC, or None when no watchdog is
    expected from this process (unset, malformed, zero, or $WATCHDOG_PID names another pid)."""
    environ = os.environ if environ is None else environ
    text = environ.get(WATCHDOG_USEC)
    if not text:
        return None
    try:
        timeout_usec = int(text)
    except ValueError:
        log.warning("ignoring malformed %s=%r", WATCHDOG_USEC, text)
        return None
    if timeout_usec <= 0:
        return None
    pid_text = environ.get(WATCHDOG_PID)
    if pid_text:
        try:
            watchdog_pid = int(pid_text)
        except ValueError:
            log.warning("ignoring the watchdog: malformed %s=%r", WATCHDOG_PID, pid_text)
            return None
        if watchdog_pid != (os.getpid() if pid is None else pid):
            return None  # meant for another process (e.g. our parent)
    return timeout_usec / 1e6 / 2


class Notifier:
    """Sends notifications to one socket; a no-op when the address is None. Thread-safe."""

    def __init__(self, address: str | bytes | None):
        self.address = address
        self._socket: socket.socket | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Notifier:
        environ = os.environ if environ is None else environ
        return cls(socket_address(environ.get(NOTIFY_SOCKET)))

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *lines: str) -> bool:
        """Sends the lines as one datagram; True when it was sent (False also when disabled)."""
        if self.address is None or not lines:
            return False
        payload = "\n".join(lines).encode()
        with self._lock:
            try:
                if self._socket is None:
                    self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._socket.sendto(payload, self.address)
                return True
            except OSError as exc:
                log.warning("sd_notify to %r failed: %s", self.address, exc)
                self._close_socket()
                return False

    def ready(self, status: str | None = None) -> bool:
        """READY=1: start-up is complete (systemd starts the units ordered after this one)."""
        return self.notify("READY=1", *_status_line(status))

    def status(self, text: str) -> bool:
        """STATUS=...: one line shown by `systemctl status`."""
        return self.notify(*_status_line(text))

    def stopping(self, status: str | None = None) -> bool:
        """STOPPING=1: the daemon has begun shutting down."""
        return self.notify("STOPPING=1", *_status_line(status))

    def watchdog(self) -> bool:
        """WATCHDOG=1: the keep-alive ping; send it every watchdog_interval_s() while healthy."""
        return self.notify("WATCHDOG=1")

    def close(self) -> None:
        with self._lock:
            self._close_socket()

    def _close_socket(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _status_line(text: str | None) -> list[str]:
    if text is None:
        return []
    return ["STATUS=" + " ".join(text.split())]  # one line: newlines would start new assignments
