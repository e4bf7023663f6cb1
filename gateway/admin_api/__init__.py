"""The admin API: stored keys, the spend report and the OpenAPI document describing the admin plane."""
