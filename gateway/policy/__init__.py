"""The security team's policy: one versioned model (`model.py`) loaded from `policies/` (`loader.py`)."""
