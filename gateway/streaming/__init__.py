"""Streamed answers as the API shapes, the guard and the relay read them: server-sent-event framing, and text a stream
grows a piece at a time."""
