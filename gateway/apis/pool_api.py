"""What every request to a pool carries in its API's way (the pool's credentials, the headers its API asks for),
whichever route sent it: a model route's exchange or a passthrough. gateway/apis/exchange.py lists each pool API's.

The base class is an OpenAI-compatible pool's: the key as a bearer token. A pool API that authenticates or versions
its requests otherwise subclasses it, beside that API's other code.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.config import PoolConfig


class PoolApi:
    """An OpenAI-compatible pool: `authorization: Bearer` with its key, where it has one."""

    def headers(self, config: PoolConfig, api_key: str | None, client_headers: Mapping[str, str]) -> dict[str, str]:
        """The headers a request to a pool with this `config` carries for its API: `api_key` is the pool's for the
        tenant (never the client's), `client_headers` the client request's (a feature it opts in to by header)."""
        return {"authorization": f"Bearer {api_key}"} if api_key else {}
