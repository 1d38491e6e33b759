"""The KV-cache-aware routing gateway service."""

from .app import create_app
from .config import Config, ConfigError, load_config, parse_config

__all__ = ["Config", "ConfigError", "create_app", "load_config", "parse_config"]
