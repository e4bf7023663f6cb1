"""The relay to upstreams: the upstream call, fallbacks across pools, and what an upstream call's span says of its
answer."""
