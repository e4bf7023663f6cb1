"""Traces, metrics and logs: OpenTelemetry and Prometheus per app, trace sampling, the per-request metric tallies, log
line formats and the log writer thread, and the release they report."""
