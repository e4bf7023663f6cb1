"""`make demo`: a trace you can see, in Arize Phoenix (`python -m gateway.demo`; docs in its `__main__`)."""
