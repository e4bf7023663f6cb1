"""The OpenAI wire protocol: request bodies in, response bodies and SSE chunks out, errors in OpenAI's shape."""
