"""Running the gateway: `portcullis up`, the multi-worker supervisor, child processes, and `portcullis config check`."""
