"""What the stores stand on: Redis clients and the SQLite file (in WAL mode) that keys, spend and tenant objects share,
and which file a path names now (for watchers and open handles)."""
