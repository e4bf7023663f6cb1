"""Hot reload of what an operator edits while the gateway runs: the watcher and SIGHUP handler every source shares, and
portcullis.yaml's reload (the policy directory's is gateway/policy/reload.py)."""
