"""Upstream pools and the policies that order their replicas for a request."""
