"""An `anthropic` pool's request headers (docs.anthropic.com "Versions" and "Beta headers"): the pinned
`anthropic-version`, the client's `anthropic-beta` as sent, the key as `x-api-key`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from gateway.apis.pool_api import PoolApi

if TYPE_CHECKING:
    from gateway.config import PoolConfig


class AnthropicPoolApi(PoolApi):
    def headers(self, config: PoolConfig, api_key: str | None, client_headers: Mapping[str, str]) -> dict[str, str]:
        headers = {"anthropic-version": config.anthropic_version}
        if beta := client_headers.get("anthropic-beta"):
            headers["anthropic-beta"] = beta  # features a client opts in to are its request's, as sent
        if api_key:
            headers["x-api-key"] = api_key
        return headers
