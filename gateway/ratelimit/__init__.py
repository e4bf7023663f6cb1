"""Rate limits: GCRA for request and token rates, leased slots for concurrency, in memory or in Redis."""
