"""Hot reload: on SIGHUP or when the config file changes, validate it and swap it in.

A reload applies completely or not at all: an invalid file, or a valid one that fails while its
parts are built (a tokenizer file that is not one), keeps the running config, and `version()`
(`/admin/config`) says what is active and why the last reload did not apply. The file watcher
outlives every failure.
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

from gateway.config import ConfigError, load_config, mask_url_passwords
from gateway.runtime.gateway import Gateway

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
        self.last_error_code: str | None = None  # invalid_config | config_not_applied
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
                try:
                    await self.reload("file changed")
                except Exception:  # never the end of watching: the next edit gets its chance
                    log.exception("reload (file changed): unexpected error")

    async def reload(self, why: str) -> bool:
        """Load, validate and apply the file; True when the new config is active, False when
        nothing changed (`last_error` says why)."""
        async with self._lock:
            digest = self._digest()
            self._seen = digest  # a bad file is not retried until it changes again
            try:
                config = load_config(self.path)
            except ConfigError as exc:
                return self._failed(why, "invalid_config", "; ".join(exc.problems))
            except ValueError as exc:  # not UTF-8, and the like
                return self._failed(why, "invalid_config", f"{self.path}: {exc}")
            try:
                await self.gateway.reconfigure(config)
            except Exception as exc:  # reconfigure swaps nothing unless every part was built
                return self._failed(
                    why,
                    "config_not_applied",
                    f"{self.path} is valid but was not applied ({type(exc).__name__}: {exc}); "
                    "the running config is unchanged",
                    traceback=True,
                )
            self.digest, self.loaded_at = digest, time.time()
            self.last_error = self.last_error_code = None
            self.reloads += 1
            log.info("reload (%s): %s applied (sha256 %s)", why, self.path, (digest or "")[:12])
            return True

    def _failed(self, why: str, code: str, error: str, traceback: bool = False) -> bool:
        self.last_error, self.last_error_code = mask_url_passwords(error), code
        log.error(
            "reload (%s): keeping the running config: %s", why, self.last_error, exc_info=traceback
        )
        return False

    def version(self) -> dict[str, Any]:
        return {
            "source": str(self.path),
            "sha256": self.digest,
            "loaded_at": self.loaded_at,
            "reloads": self.reloads,
            "last_error": self.last_error,
        }
