"""The KV-cache-aware routing gateway service."""

from gateway.config import Config, ConfigError, load_config, parse_config
from gateway.http.app import create_app

__all__ = ["Config", "ConfigError", "create_app", "load_config", "parse_config"]
