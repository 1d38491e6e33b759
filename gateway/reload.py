"""Hot reload: on SIGHUP or when the config file changes, validate it and swap it in.

An invalid file keeps the running config and logs why; `version()` says what is active
(`/admin/config`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import signal
import time
from pathlib import Path
from typing import Any

from .config import ConfigError, load_config
from .runtime import Gateway

log = logging.getLogger("gateway.reload")


class ConfigReloader:
    def __init__(self, gateway: Gateway, path: str | Path, interval_s: float = 2.0) -> None:
        self.gateway = gateway
        self.path = Path(path)
        self.interval_s = interval_s
        self.digest = self._digest()  # of the active config
        self._seen = self.digest  # of the file last looked at, valid or not
        self.loaded_at = time.time()
        self.reloads = 0
        self.last_error: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._sighup = False

    def _digest(self) -> str | None:
        try:
            return hashlib.sha256(self.path.read_bytes()).hexdigest()
        except OSError:
            return None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="config-watch")
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(
                signal.SIGHUP, lambda: asyncio.ensure_future(self.reload("SIGHUP"))
            )
            self._sighup = True

    async def stop(self) -> None:
        if self._sighup:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            digest = self._digest()
            if digest is not None and digest != self._seen:
                await self.reload("file changed")

    async def reload(self, why: str) -> bool:
        """Load, validate and apply the file; True when the new config is active."""
        async with self._lock:
            digest = self._digest()
            self._seen = digest  # a bad file is not retried until it changes again
            try:
                config = load_config(self.path)
            except ConfigError as exc:
                self.last_error = "; ".join(exc.problems)
                log.error(
                    "reload (%s): %s is invalid, keeping the running config: %s",
                    why,
                    self.path,
                    self.last_error,
                )
                return False
            await self.gateway.reconfigure(config)
            self.digest, self.loaded_at, self.last_error = digest, time.time(), None
            self.reloads += 1
            log.info("reload (%s): %s applied (sha256 %s)", why, self.path, (digest or "")[:12])
            return True

    def version(self) -> dict[str, Any]:
        return {
            "source": str(self.path),
            "sha256": self.digest,
            "loaded_at": self.loaded_at,
            "reloads": self.reloads,
            "last_error": self.last_error,
        }
