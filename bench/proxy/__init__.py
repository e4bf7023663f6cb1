"""What `python -m bench.proxy_bench` measures beyond its base table (direct, nginx, the gateway with its access log
on and off, LiteLLM): one module per option."""
