"""One upstream MCP server: its credential and its connections."""

from __future__ import annotations

import aiohttp

from gateway.config import McpServerConfig


class McpServer:
    def __init__(self, config: McpServerConfig) -> None:
        self.config = config
        self.credential = config.credential()  # at start: a variable that is not set stops it, naming the key
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """Created on first use, inside the running event loop."""
        if self._session is None:
            config = self.config
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=config.connect_timeout, sock_read=config.idle_timeout
                ),
                auto_decompress=False,
                trust_env=False,
                skip_auto_headers=("user-agent",),
                cookie_jar=aiohttp.DummyCookieJar(),  # shared by every caller: no cookie of one rides on another's
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
