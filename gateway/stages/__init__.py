"""Pipeline stages, one module each, in request order: parse → WAF → auth → tokenize → rate limits → admission →
guard → route (gateway/app.py builds the list)."""
