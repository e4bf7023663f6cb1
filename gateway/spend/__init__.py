"""Spend: what each request cost, kept per hour, key, tenant and model; budgets that bound it."""
