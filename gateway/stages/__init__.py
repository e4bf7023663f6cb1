"""Pipeline stages, one module each, in request order: parse → WAF → auth → authority (per attempt: the key's model
allow-list, tokenize, rate limits and budgets for the model the attempt calls) → admission → guard → route
(gateway/app.py builds the list)."""
