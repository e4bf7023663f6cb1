"""Admission: exact prompt token counts per model, and the KV-cache budget with its fair queue."""
