"""What every benchmark through the API shares: processes, the static nginx upstream, the gateways, wrk, reports."""
