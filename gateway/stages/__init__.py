"""Pipeline stages, one module each, in request order: parse → auth → route (WAF, rate limits, admission and
guard slot in between as they land)."""
