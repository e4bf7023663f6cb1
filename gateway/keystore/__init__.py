"""Stored API keys: created, rotated and revoked at run time through the admin API, seen by every instance."""
