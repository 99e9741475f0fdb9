"""systemd's notify protocol (sd_notify(3)), spoken by hand: one datagram per state change on the
unix socket named by ``$NOTIFY_SOCKET``. No dependency: the protocol is ``KEY=VALUE`` lines in a
datagram, and python-systemd would pull a C extension onto every device for that.

Used by the daemon only when ``NOTIFY_SOCKET`` is set (``Type=notify`` in
deploy/systemd/coterie-node.service): ``READY=1`` once the ports are bound, ``WATCHDOG=1`` at half
of ``$WATCHDOG_USEC`` from a task on the daemon's event loop (a stalled loop stops the pings and
systemd restarts the node), ``RELOADING=1`` / ``READY=1`` around a SIGHUP reload, ``STOPPING=1``
on the way out. A failed send is logged once and never stops the node: a node under a supervisor
that has gone away keeps learning."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

log = logging.getLogger("coterie.node")


class Notifier:
    """Sends states to the service manager's socket ``address`` (a path, or ``@name``: Linux's
    abstract namespace). ``watchdog_s``: how often the manager expects ``WATCHDOG=1`` (None: it
    expects none)."""

    def __init__(self, address: str, watchdog_s: float | None = None):
        if not address or address[0] not in "/@":
            raise ValueError(f"NOTIFY_SOCKET must be an absolute path or @abstract name, got {address!r}")
        self.address = "\0" + address[1:] if address[0] == "@" else address
        self.watchdog_s = watchdog_s
        self.sent = 0
        self._warned = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Notifier | None:
        """The notifier systemd asked for, or None when this process is not under one."""
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        if not address:
            return None
        return cls(address, _watchdog_s(env))

    def notify(self, *states: str) -> bool:
        """Send ``states`` (``"READY=1"``, ``"STATUS=..."``) in one datagram; False if it did not go."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.setblocking(False)  # on the event loop: a backed-up manager drops a ping, never stalls it
                s.sendto("\n".join(states).encode(), self.address)
        except OSError as e:
            if not self._warned:  # once: a vanished manager would otherwise log every ping
                log.warning("sd_notify to %s failed (%s); the node carries on", self.address.lstrip("\0"), e)
                self._warned = True
            return False
        self.sent += 1
        return True

    def reloading(self) -> None:
        # MONOTONIC_USEC: systemd >= 253 pairs it with the READY=1 that ends the reload
        self.notify("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")

    async def watchdog(self, alive: Callable[[], bool] = lambda: True) -> None:
        """Ping at half the watchdog interval while ``alive()`` (runs until cancelled)."""
        if self.watchdog_s is None:
            return
        while True:
            if alive():
                self.notify("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_s / 2)  # the protocol's own period, not a race


def _watchdog_s(env: Mapping[str, str]) -> float | None:
    """``$WATCHDOG_USEC`` in seconds, if it is meant for this process (``$WATCHDOG_PID``, when set,
    names the process the manager watches)."""
    usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid != str(os.getpid()):
        return None
    return int(usec) / 1e6
