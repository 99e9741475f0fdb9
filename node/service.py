"""A node under a service manager: SIGHUP reloads the config (``reload.py``); SIGUSR1 writes every
thread's stack to stderr (``faulthandler``: works even when the event loop is stuck) and SIGUSR2
logs every asyncio task's stack (what a stuck round is waiting on); under systemd
(``$NOTIFY_SOCKET`` set, ``sd_notify.py``) the node says when it is ready, pings the watchdog from
its event loop, and marks reloads and its stop. Nothing here runs without a signal or the socket:
a node started by hand behaves as before."""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import signal
from collections.abc import Callable
from typing import Any

from .config import NodeConfig
from .reload import Reloader, Running
from .sd_notify import Notifier
from .stacks import dump_tasks

log = logging.getLogger("coterie.node")


class Service:
    def __init__(self, node: Running, load: Callable[[], NodeConfig] | None, running: NodeConfig):
        self.node = node
        self.reloader = Reloader(node, load, running)
        try:
            self.notifier = Notifier.from_env()
        except ValueError as e:  # a malformed NOTIFY_SOCKET: say so, run without it
            log.warning("%s: not notifying the service manager", e)
            self.notifier = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reload_again = False  # a SIGHUP during a reload: one more reload after it
        self._stopping = False

    def start(self) -> None:
        """After ``node.start()``: the ports are bound and node.json is written."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, self._on_hup)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        loop.add_signal_handler(signal.SIGUSR2, dump_tasks)
        if self.notifier is not None:
            self.notifier.notify("READY=1", self._status())
            stalled = self.node.stall_watch  # a stalled round: no pings, so systemd restarts the node
            self._spawn(self.notifier.watchdog(lambda: not stalled.restart_worthy), "sd-watchdog")

    def stopping(self) -> None:
        """SIGTERM arrived: reloads are over; the watchdog keeps pinging while checkpoints are written."""
        self._stopping = True
        if self.notifier is not None:
            self.notifier.notify("STOPPING=1", "STATUS=stopping: writing pending checkpoints")

    async def close(self) -> None:
        """After the node stopped. The SIGHUP handler stays: a HUP now is ignored, not fatal."""
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _status(self) -> str:
        n = self.node
        return f"STATUS=node {n.node_id} at {n.address or 'no peer port'}, round {n.round}"

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_hup(self) -> None:
        if self._stopping:
            log.info("SIGHUP while stopping: not reloading")
            return
        if any(t.get_name() == "reload" for t in self._tasks):
            self._reload_again = True
            return
        self._spawn(self._reload(), "reload")

    async def _reload(self) -> None:
        while True:
            self._reload_again = False
            if self.notifier is not None:
                self.notifier.reloading()
            outcome = await self.reloader.reload()
            self.node.reload_outcome = outcome
            if self.notifier is not None:
                self.notifier.notify("READY=1", self._status())
            if not self._reload_again:
                return
