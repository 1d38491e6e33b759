"""The gateway's vocabulary: the ASGI shapes every module speaks, named once."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Message = MutableMapping[str, Any]  # one ASGI event (http.request, http.response.body, ...)
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]  # raw header pairs, lower-case names, in order
