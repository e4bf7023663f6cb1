"""The engine's HTTP layer: the OpenAI-compatible server, its wire protocol, and the stream between the engine's outputs
and a response."""
