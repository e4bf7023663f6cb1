"""Admission: the KV-cache budget and its fair queue (the prompt counts it prices come from gateway.tokenization)."""
