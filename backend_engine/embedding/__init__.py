"""Sentence-embedding models the engine serves on /v1/embeddings beside its chat model: a BERT encoder in numpy
(`bert`) behind a tokenizer, batching and pooling (`encoder`)."""
