"""Tenant-owned objects: what a tenant makes upstream through the gateway (files, stored responses, batches...) is
that tenant's alone, though every tenant reaches the upstream with the pool's one key."""
