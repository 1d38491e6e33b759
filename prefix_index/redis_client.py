"""Redis URLs to redis.asyncio clients: one node, Sentinel, Cluster; TLS; ACL users.

The forms (docs/deploy.md#redis):

    redis://[user:password@]host[:port][/db][?option=value&...]     one node
    rediss://...                                                    one node over TLS
    unix://[user:password@]/path/redis.sock[?db=N]                  one node, a local socket
    redis+sentinel://[user:password@]host[:port][,host[:port]...]/master[/db][?...]
    rediss+sentinel://...                                           TLS to sentinels and nodes
    redis+cluster://[user:password@]host[:port][,host[:port]...][?...]
    rediss+cluster://...

The user and password in the URL are the data nodes' (an ACL user, or `:password` for the
default user); a Sentinel set's own are `sentinel_username` / `sentinel_password` options.
Ports default to 6379 (26379 for sentinels). Options: socket_timeout, socket_connect_timeout,
socket_keepalive, health_check_interval, client_name, max_connections, username, password; with
TLS ssl_ca_certs, ssl_ca_path, ssl_certfile, ssl_keyfile, ssl_password, ssl_cert_reqs
(none|optional|required), ssl_check_hostname. What the URL leaves out may come from the
environment: KVGW_REDIS_<OPTION> for the credentials and TLS files (ENV_OPTIONS), so a secret
needs no place in routes.yaml. Messages never repeat the URL (it may hold a password).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qsl, unquote, urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import ConnectionPool, SSLConnection, UnixDomainSocketConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import ClusterDownError, RedisClusterException, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# What Redis going away raises, one node or a Cluster. A Cluster mid-failover answers
# CLUSTERDOWN / TRYAGAIN or has slots no node serves: an outage too (buffer, answer locally,
# probe), not a refusal to drop writes over. redis-py's cluster client can also race a node's
# disconnect and write to a connection it already closed (AttributeError: 'NoneType' object
# has no attribute 'writelines', seen under load in tests/redis_ha): the node going away too.
OUTAGE = (RedisConnectionError, RedisTimeoutError, OSError, TimeoutError, ClusterDownError,
          TryAgainError, RedisClusterException, AttributeError)  # fmt: skip

Kind = Literal["node", "sentinel", "cluster"]


async def cancel(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel the tasks still running and wait for each to end. A task that talks to Redis may
    swallow one cancellation (redis-py's cluster client mapping its slots again mid-failover
    has; a stop then waited forever, seen in tests/redis_ha): the cancellation is repeated
    every second until the task ends."""
    for task in tasks:
        if task is None:
            continue
        while not task.done():
            task.cancel()
            await asyncio.wait((task,), timeout=1.0)
        if not task.cancelled():
            task.exception()  # retrieved: an error on its way out is not logged as never seen

Client = Redis | RedisCluster
FORMS = (
    "redis://[user:password@]host:port/db, rediss://... (TLS), unix:///path.sock, "
    "redis+sentinel://host:port,host:port/master/db or redis+cluster://host:port,host:port"
)
_SCHEMES: dict[str, tuple[Kind, bool]] = {
    "redis": ("node", False),
    "rediss": ("node", True),
    "unix": ("node", False),
    "redis+sentinel": ("sentinel", False),
    "rediss+sentinel": ("sentinel", True),
    "redis+cluster": ("cluster", False),
    "rediss+cluster": ("cluster", True),
}
_BOOL = {"1": True, "true": True, "yes": True, "on": True,
         "0": False, "false": False, "no": False, "off": False}  # fmt: skip
_NUMBER = {"socket_timeout": float, "socket_connect_timeout": float,
           "health_check_interval": float, "max_connections": int, "db": int}  # fmt: skip
_FLAG = {"socket_keepalive", "ssl_check_hostname"}
_TEXT = {"client_name", "username", "password"}
_TLS = {"ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile", "ssl_password",
        "ssl_cert_reqs", "ssl_check_hostname"}  # fmt: skip
_FILES = {"ssl_ca_certs": "file", "ssl_ca_path": "directory", "ssl_certfile": "file",
          "ssl_keyfile": "file"}  # fmt: skip
_SENTINEL = {"sentinel_username", "sentinel_password"}
# Options the environment may give when the URL does not (KVGW_REDIS_PASSWORD, ...).
ENV_OPTIONS = ("username", "password", "sentinel_username", "sentinel_password",
               "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_password")  # fmt: skip
ENV_PREFIX = "KVGW_REDIS_"
SECRET_OPTIONS = ("password", "sentinel_password", "ssl_password")


class RedisUrlError(ValueError):
    """A Redis URL that cannot be opened; the message never holds the URL."""


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """What a URL names: the kind, the hosts to ask first, and the connection options."""

    kind: Kind
    tls: bool
    hosts: tuple[tuple[str, int], ...]  # the node, the sentinels or the cluster's seed nodes
    options: Mapping[str, Any] = field(default_factory=dict)  # data-node connection kwargs
    master: str | None = None  # Sentinel: the monitored master's name
    sentinel_options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def where(self) -> str:
        """Where it points, without credentials (for logs)."""
        hosts = ",".join(f"{h}:{p}" for h, p in self.hosts) or str(self.options.get("path"))
        tls = " (TLS)" if self.tls else ""
        if self.kind == "sentinel":
            return f"Sentinel master {self.master!r} via {hosts}{tls}"
        if self.kind == "cluster":
            return f"Cluster via {hosts}{tls}"
        return f"{hosts}/{self.options.get('db', 0)}{tls}"


@dataclass(slots=True)
class RedisHealth:
    """What a Redis user (the index, the rate limiter) went through, for metrics and /ready:
    `up` now, outages and recoveries since start, seconds spent down in finished outages,
    Sentinel master switches followed without an outage, and for the index the rebuilds after
    Redis lost its data and the writes they replayed."""

    up: bool = True
    outages: int = 0
    recoveries: int = 0
    switches: int = 0
    down_s: float = 0.0
    rebuilds: int = 0
    replayed_writes: int = 0
    last_error: str = ""
    down_at: float = 0.0  # time.monotonic() when the outage began

    def went_down(self, exc: BaseException) -> None:
        """An outage begins (its user saw Redis up until `exc`)."""
        self.up = False
        self.outages += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        self.down_at = time.monotonic()

    def came_back(self) -> float:
        """The outage ends: its length in seconds."""
        down_s = time.monotonic() - self.down_at
        self.up = True
        self.recoveries += 1
        self.down_s += down_s
        return down_s


def parse_redis_url(url: str, env: Mapping[str, str] | None = None) -> RedisTarget:
    """The target `url` names, options from the environment (`env`, default os.environ) filling
    what the URL leaves out. Raises RedisUrlError."""
    env = os.environ if env is None else env
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in _SCHEMES:
        raise RedisUrlError(f"not a Redis URL (expected {FORMS})")
    scheme = scheme.lower()
    kind, tls = _SCHEMES[scheme]
    # the last @ ends the userinfo: a password may hold an unescaped @ / ? or #
    userinfo, at, location = rest.rpartition("@")
    location, _, _fragment = location.partition("#")
    location, _, query = location.partition("?")
    netloc, slash, path = location.partition("/")
    options = _options(query, kind, tls)
    if at:
        user, colon, password = userinfo.partition(":")
        if user:
            options.setdefault("username", unquote(user))
        if colon and password:
            options.setdefault("password", unquote(password))
    from_env = set()
    for name in ENV_OPTIONS:
        value = env.get(ENV_PREFIX + name.upper())
        if value and name not in options and (tls or not name.startswith("ssl_")):
            if kind == "sentinel" or not name.startswith("sentinel_"):
                options[name] = value
                from_env.add(name)
    for name, what in _FILES.items():
        if name in options and not _exists(options[name], what):
            source = f" (from {ENV_PREFIX}{name.upper()})" if name in from_env else ""
            raise RedisUrlError(f"{name}: no readable {what} at {options[name]}{source}")
    sentinel = {
        k.removeprefix("sentinel_"): options.pop(k) for k in list(options) if k in _SENTINEL
    }
    if scheme == "unix":
        if netloc:
            raise RedisUrlError(f"not a Redis URL: a socket URL has no host (expected {FORMS})")
        if not path:
            raise RedisUrlError(f"not a Redis URL: no socket path (expected {FORMS})")
        return RedisTarget(kind, tls, (), {"path": "/" + unquote(path), **options})
    default_port = 26379 if kind == "sentinel" else 6379
    hosts = tuple(_host(h, default_port) for h in netloc.split(","))
    if kind == "node" and len(hosts) > 1:
        raise RedisUrlError(
            "not a Redis URL: several hosts need redis+sentinel:// or redis+cluster://"
        )
    parts = path.split("/") if slash and path else []
    if kind == "sentinel":
        if not parts or not parts[0]:
            raise RedisUrlError(
                "not a Redis URL: a Sentinel URL names the master after the hosts, like "
                "redis+sentinel://host:26379/mymaster/0"
            )
        master, *more = parts
        options.setdefault("db", _db(more, "/master"))
        return RedisTarget(kind, tls, hosts, options, unquote(master), sentinel)
    db = _db(parts, "")
    if kind == "cluster":
        if db or options.get("db"):
            raise RedisUrlError("not a Redis URL: a Redis Cluster has one database, 0")
        options.pop("db", None)
        return RedisTarget(kind, tls, hosts, options)
    options.setdefault("db", db)
    return RedisTarget(kind, tls, hosts, options)


def redis_url_problem(url: str, env: Mapping[str, str] | None = None) -> str | None:
    """Why `url` cannot be opened, or None (the message never holds the URL)."""
    try:
        parse_redis_url(url, env)
    except RedisUrlError as exc:
        return str(exc)
    return None


def open_redis(
    url: str | RedisTarget,
    *,
    socket_timeout: float | None,
    connect_timeout: float,
    max_connections: int | None = None,
    retries: int = 1,
) -> Client:
    """A client for `url` that connects on first use (never here). Sentinel: a master client
    that asks the sentinels where the master is on every new connection, and drops connections
    to a master demoted to replica (READONLY); before that, after a graceful switch, its user
    moves to a new client (prefix_index/redis_follow.py). Cluster: a RedisCluster (follows MOVED/ASK, maps
    the slots again when a node is lost). Options in the URL win over these arguments."""
    target = parse_redis_url(url) if isinstance(url, str) else url
    base: dict[str, Any] = {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": connect_timeout,
        "decode_responses": False,
    }
    if max_connections is not None:
        base["max_connections"] = max_connections
    kwargs = {**base, **target.options}
    if target.kind == "cluster":
        kwargs.pop("health_check_interval", None)
        return RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in target.hosts],
            ssl=target.tls,
            retry=Retry(NoBackoff(), retries),
            **kwargs,
        )
    kwargs["retry"] = Retry(NoBackoff(), retries)
    if target.kind == "sentinel":
        assert target.master is not None
        sentinel_kwargs: dict[str, Any] = {
            "socket_timeout": socket_timeout if socket_timeout is not None else connect_timeout,
            "socket_connect_timeout": connect_timeout,
            **target.sentinel_options,
        }
        if target.tls:
            sentinel_kwargs.update(
                {k: v for k, v in target.options.items() if k.startswith("ssl_")}, ssl=True
            )
            kwargs["ssl"] = True
        sentinel = Sentinel(target.hosts, sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call, unused-ignore]
        client: Redis = sentinel.master_for(target.master, redis_class=_SentinelMaster, **kwargs)
        return client
    if "path" in kwargs:
        kwargs["connection_class"] = UnixDomainSocketConnection
    else:
        kwargs["host"], kwargs["port"] = target.hosts[0]
        if target.tls:
            kwargs["connection_class"] = SSLConnection
    return Redis.from_pool(ConnectionPool(**kwargs))


def redact_url(url: str) -> str:
    """`url` with its password, and any password option, shown as `***`."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    userinfo, at, location = rest.rpartition("@")  # as parse_redis_url reads it
    location, hash_, fragment = location.partition("#")
    location, q, query = location.partition("?")
    if q:
        pairs = [
            f"{k}=***" if k.lower() in SECRET_OPTIONS else f"{k}={v}"
            for k, _, v in (p.partition("=") for p in query.split("&"))
        ]
        location += "?" + "&".join(pairs)
    if at:
        user, colon, password = userinfo.partition(":")
        location = (f"{user}:***" if colon and password else user) + f"@{location}"
    return f"{scheme}://{location}{hash_}{fragment}"


# -- parsing helpers ---------------------------------------------------------------------------


def _options(query: str, kind: Kind, tls: bool) -> dict[str, Any]:
    known = set(_NUMBER) | _FLAG | _TEXT | (_TLS if tls else set())
    if kind == "sentinel":
        known |= _SENTINEL
    out: dict[str, Any] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in known:
            hint = " (TLS options need rediss)" if name in _TLS else ""
            raise RedisUrlError(
                f"not a Redis URL: unknown option {name!r}{hint} (known: {', '.join(sorted(known))})"
            )
        try:
            if name in _NUMBER:
                number = _NUMBER[name](value)
                if number < 0:
                    raise ValueError
                out[name] = number
            elif name in _FLAG:
                out[name] = _BOOL[value.lower()]
            elif name == "ssl_cert_reqs":
                if value not in ("none", "optional", "required"):
                    raise ValueError
                out[name] = value
            else:
                out[name] = value
        except (KeyError, ValueError):
            raise RedisUrlError(f"not a Redis URL: invalid value for option {name!r}") from None
    return out


def _host(text: str, default_port: int) -> tuple[str, int]:
    try:
        parts = urlsplit(f"//{text}")
        port = parts.port
    except ValueError:
        raise RedisUrlError(
            f"not a Redis URL: a port is not a number from 0 to 65535 (expected {FORMS})"
        ) from None
    if not parts.hostname:
        raise RedisUrlError(f"not a Redis URL: no host (expected {FORMS})")
    return parts.hostname, port or default_port


def _db(parts: list[str], after: str) -> int:
    parts = [p for p in parts if p]
    if not parts:
        return 0
    if len(parts) > 1 or not parts[0].isdigit():
        raise RedisUrlError(
            f"not a Redis URL: the database after the host{after} must be a number, like /0"
        )
    return int(parts[0])


def _exists(path: str, what: str) -> bool:
    p = Path(path)
    return (p.is_dir() if what == "directory" else p.is_file()) and os.access(p, os.R_OK)


class _SentinelMaster(Redis):
    """A master client that also closes its sentinels' connections."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        pool: Any = self.connection_pool
        await super().aclose(close_connection_pool)
        for sentinel in pool.sentinel_manager.sentinels:
            await sentinel.aclose()
