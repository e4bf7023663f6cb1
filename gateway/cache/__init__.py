"""The response cache: an answer served again to the same tenant for the same canonical request.

`key.py` says which requests it serves and what identifies one; `stores.py` keeps answers (this process's memory, or
Redis for a fleet); `replay.py` turns a stored answer into the stream a streaming client asks for, `assemble.py` a
stream that passed into the answer to store, `fill.py` stores a missed request's answer; `semantic.py` is the opt-in
match of a paraphrase to an earlier question. gateway/stages/cache.py is the stage that serves hits and fills the
cache on misses.
"""
