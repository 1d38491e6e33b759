"""Every Redis URL form, as the gateway reads it at load (`gateway check`) and opens it: the target
it names, the error (with its key path) for a bad one, credentials from the environment, and the
password masked wherever the URL is shown."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.config import ConfigError, mask_url_passwords, parse_config
from prefix_index.redis_client import RedisUrlError, parse_redis_url, redact_url

POOL = {"pools": {"chat": {"replicas": ["http://127.0.0.1:9001"]}}}
NO_ENV: dict[str, str] = {}

GOOD = [
    # url, kind, tls, hosts, selected options (checked as a subset), master
    ("redis://127.0.0.1:6379/0", "node", False, [("127.0.0.1", 6379)], {"db": 0}, None),
    ("redis://cache", "node", False, [("cache", 6379)], {"db": 0}, None),
    ("redis://alice:s%3Acret@h:7000/3?socket_timeout=0.5", "node", False, [("h", 7000)],
     {"db": 3, "username": "alice", "password": "s:cret", "socket_timeout": 0.5}, None),
    ("redis://:p@ss@h/1", "node", False, [("h", 6379)], {"password": "p@ss", "db": 1}, None),
    ("rediss://h:6380/0?ssl_cert_reqs=none&ssl_check_hostname=false", "node", True,
     [("h", 6380)], {"ssl_cert_reqs": "none", "ssl_check_hostname": False}, None),
    ("redis://[::1]:6379/2", "node", False, [("::1", 6379)], {"db": 2}, None),
    ("unix:///run/redis.sock?db=4", "node", False, [], {"path": "/run/redis.sock", "db": 4}, None),
    ("redis+sentinel://s1,s2:26380,s3:26381/mymaster/2", "sentinel", False,
     [("s1", 26379), ("s2", 26380), ("s3", 26381)], {"db": 2}, "mymaster"),
    ("redis+sentinel://:nodepw@s1/mymaster?sentinel_password=sentpw", "sentinel", False,
     [("s1", 26379)], {"db": 0, "password": "nodepw"}, "mymaster"),
    ("rediss+sentinel://s1:26379/m/0?ssl_cert_reqs=required", "sentinel", True, [("s1", 26379)],
     {"ssl_cert_reqs": "required"}, "m"),
    ("redis+cluster://n1:7000,n2:7001", "cluster", False, [("n1", 7000), ("n2", 7001)], {}, None),
    ("redis+cluster://u:pw@n1", "cluster", False, [("n1", 6379)],
     {"username": "u", "password": "pw"}, None),
    ("rediss+cluster://n1:7000/0", "cluster", True, [("n1", 7000)], {}, None),
]  # fmt: skip


@pytest.mark.parametrize(("url", "kind", "tls", "hosts", "options", "master"), GOOD)
def test_every_form_names_its_target(
    url: str, kind: str, tls: bool, hosts: list[Any], options: dict[str, Any], master: str | None
) -> None:
    target = parse_redis_url(url, NO_ENV)
    assert (target.kind, target.tls, list(target.hosts), target.master) == (
        kind, tls, hosts, master
    )  # fmt: skip
    assert options.items() <= dict(target.options).items(), target.options
    if "sentinel_password" in url:
        assert target.sentinel_options == {"password": "sentpw"}
    cfg = parse_config({**POOL, "index": {"backend": "redis", "redis_url": url}})
    assert cfg.index.redis_url == url  # the config keeps the URL as written


BAD = [
    ("not-a-url", "not a Redis URL (expected"),
    ("http://127.0.0.1:6379/0", "not a Redis URL (expected"),
    ("redis://", "no host"),
    ("redis://127.0.0.1:notaport/0", "port is not a number"),
    ("redis://h:6379/zero", "database after the host must be a number"),
    ("redis://h:6379/0?socket_timeout=soon", "invalid value for option 'socket_timeout'"),
    ("redis://h/0?bogus=1", "unknown option 'bogus'"),
    ("redis://h/0?ssl_ca_certs=/x", "TLS options need rediss"),
    ("redis://a:1,b:2/0", "several hosts need redis+sentinel:// or redis+cluster://"),
    ("unix://", "no socket path"),
    ("redis+sentinel://s1:26379", "names the master after the hosts"),
    ("redis+sentinel://s1:26379/m/x", "after the host/master must be a number"),
    ("redis+sentinel://s1:99999/m", "port is not a number"),
    ("redis+cluster://n1/3", "a Redis Cluster has one database, 0"),
    ("redis+cluster://n1?sentinel_password=x", "unknown option 'sentinel_password'"),
    ("rediss://h/0?ssl_ca_certs=/nonexistent/ca.pem", "ssl_ca_certs: no readable file"),
]


@pytest.mark.parametrize(("url", "why"), BAD)
@pytest.mark.parametrize("section", ["index", "ratelimit"])
def test_a_bad_url_names_its_key_and_why(section: str, url: str, why: str) -> None:
    with pytest.raises(RedisUrlError, match=None) as direct:
        parse_redis_url(url, NO_ENV)
    assert why in str(direct.value), direct.value
    with pytest.raises(ConfigError) as info:
        parse_config({**POOL, section: {"backend": "redis", "redis_url": url}})
    (line,) = info.value.problems
    # an option's problem reads as a key below the URL: index.redis_url.ssl_ca_certs: ...
    assert line.startswith((f"{section}.redis_url: ", f"{section}.redis_url.ssl_")), line
    assert why.removeprefix("ssl_ca_certs: ") in line, line


def test_a_password_is_never_in_an_error() -> None:
    for url in ("redis://:hunter2@host:70000/0", "redis+sentinel://:hunter2@s1/m/x",
                "redis+cluster://u:hunter2@n1/5", "redis://h/0?password=hunter2&bogus=1"):  # fmt: skip
        with pytest.raises(ConfigError) as info:
            parse_config({**POOL, "index": {"redis_url": url}})
        assert "hunter2" not in str(info.value), info.value


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://u:hunter2@h:6379/0", "redis://u:***@h:6379/0"),
        ("redis://:hun@ter2@h/0", "redis://:***@h/0"),
        ("redis://h/0?password=hunter2&db=1", "redis://h/0?password=***&db=1"),
        ("redis+sentinel://:hunter2@s1,s2/m/0?sentinel_password=hunter2",
         "redis+sentinel://:***@s1,s2/m/0?sentinel_password=***"),
        ("rediss+cluster://u:hunter2@n1:7000?ssl_password=hunter2",
         "rediss+cluster://u:***@n1:7000?ssl_password=***"),
        ("redis://user@h/0", "redis://user@h/0"),
    ],
)  # fmt: skip
def test_passwords_are_masked_where_urls_are_shown(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert mask_url_passwords({"u": [f"see {url} now"]}) == {"u": [f"see {shown} now"]}
    if "?" not in url or "sentinel" in url:
        cfg = parse_config({**POOL, "index": {"redis_url": url}, "ratelimit": {"redis_url": url}})
        shown_cfg = cfg.redacted()
        assert "hunter2" not in str(shown_cfg)
        assert shown_cfg["index"]["redis_url"] == shown == shown_cfg["ratelimit"]["redis_url"]


def test_credentials_and_tls_files_come_from_the_environment(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("not read at parse time")
    env = {
        "KVGW_REDIS_USERNAME": "gw",
        "KVGW_REDIS_PASSWORD": "from-env",
        "KVGW_REDIS_SENTINEL_PASSWORD": "sent-env",
        "KVGW_REDIS_SSL_CA_CERTS": str(ca),
    }
    plain = parse_redis_url("redis://h/0", env)
    assert (plain.options["username"], plain.options["password"]) == ("gw", "from-env")
    assert "ssl_ca_certs" not in plain.options  # TLS files only for rediss
    tls = parse_redis_url("rediss+sentinel://s1/m/0", env)
    assert tls.options["ssl_ca_certs"] == str(ca)
    assert tls.sentinel_options == {"password": "sent-env"}
    assert "sentinel_password" not in parse_redis_url("redis+cluster://n1", env).options
    explicit = parse_redis_url("redis://other:pw@h/0", env)  # the URL's own win
    assert (explicit.options["username"], explicit.options["password"]) == ("other", "pw")
    env["KVGW_REDIS_SSL_CA_CERTS"] = str(tmp_path / "missing.pem")
    with pytest.raises(RedisUrlError, match="ssl_ca_certs: no readable file"):
        parse_redis_url("rediss://h/0", env)


def test_the_config_reads_the_environment_at_load(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVGW_REDIS_SSL_CA_CERTS", str(tmp_path / "gone.pem"))
    with pytest.raises(ConfigError) as info:
        parse_config({**POOL, "index": {"redis_url": "rediss://h/0"}})
    assert info.value.problems == [
        f"index.redis_url.ssl_ca_certs: no readable file at {tmp_path / 'gone.pem'} "
        "(from KVGW_REDIS_SSL_CA_CERTS)"
    ]
    monkeypatch.setenv("REDIS_PW", "hunter2")  # `${ENV}` in routes.yaml works as well
    cfg = parse_config({**POOL, "index": {"redis_url": "redis://:${REDIS_PW}@h/0"}})
    assert "hunter2" not in str(cfg.redacted())
