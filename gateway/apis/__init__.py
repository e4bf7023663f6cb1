"""The request shapes the gateway speaks (OpenAI chat, completions, Responses, embeddings; Anthropic Messages): what
each one's text is, how it is counted, and how it travels to a pool that speaks another shape."""
