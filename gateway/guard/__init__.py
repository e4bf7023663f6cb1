"""Guardrails: the ONNX prompt-injection classifier, its micro-batcher, PII/secrets detectors, the output guard."""
