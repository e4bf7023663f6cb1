"""`--cache`: what a response cache hit costs beside the gateway's own overhead."""

from __future__ import annotations

from bench.harness.gateways import REPO


# --cache's rows: the repo's base policy, the response cache on (a TTL no run outlasts)
def cache_policy() -> dict:
    import yaml

    base = yaml.safe_load((REPO / "policies" / "base.yaml").read_text())
    return {**base, "spec": {**base["spec"], "cache": {"enabled": True, "ttl": "1h"}}}


CACHE_ROWS = (  # target, label, response_cache.store
    ("portcullis_cache_memory", "Portcullis, response cache hit (memory)", "memory"),
    ("portcullis_cache_redis", "Portcullis, response cache hit (Redis)", "redis"),
)
