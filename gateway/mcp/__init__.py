"""The MCP gateway: upstream MCP servers (`mcp_servers:` in portcullis.yaml) served at `/mcp/{name}` as a JSON-RPC
relay over streamable HTTP, with the gateway's keys, policies, WAF, guard, limits, spans and audit log (docs/mcp.md).
"""
