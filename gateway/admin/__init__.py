"""The admin plane: its own listener, the checks every admin request passes, its token, the audit log, the admin API
(stored keys, the spend report, the OpenAPI document) and `portcullis keys`."""
