"""The HTTP edge: the server, and what a request's bytes meet before the pipeline (bounds, the client's address and
exit, lingering close, CPU work off the event loop)."""
