"""The standard OpenTelemetry environment variables, as defaults for portcullis.yaml's `telemetry` section.

The OpenTelemetry convention: an environment variable is a default, and what the operator writes in the config file
overrides it. So each key `telemetry` leaves out takes its variable's value where one is set:

- `OTEL_SERVICE_NAME`, else `service.name` in `OTEL_RESOURCE_ATTRIBUTES` -> `service_name` (the other resource
  attributes of `OTEL_RESOURCE_ATTRIBUTES` are added to every span's resource by the SDK);
- `OTEL_EXPORTER_OTLP_ENDPOINT` -> `otlp.endpoint`, and turns export on (`otlp.enabled`) unless `OTEL_SDK_DISABLED`
  is true or `OTEL_TRACES_EXPORTER` is `none`;
- `OTEL_EXPORTER_OTLP_PROTOCOL` (`http/protobuf` or `grpc`) -> `otlp.protocol`;
- `OTEL_TRACES_SAMPLER` with `OTEL_TRACES_SAMPLER_ARG` -> `sampling_ratio`: `always_on` 1, `always_off` 0,
  `traceidratio` the argument (1 without one); the `parentbased_` forms alike. The gateway's sampler is always parent
  based (a trusted parent's choice is followed: `trust_client_trace`), and keeps a failed request's trace whatever the
  ratio (gateway/observability/trace_sampling.py).

`OTEL_EXPORTER_OTLP_HEADERS` is read by the exporter itself when `otlp.headers_env` names no variable. A variable
whose value cannot be used stops the gateway at start, naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, get_args

from gateway.config import ConfigError, OtlpConfig, TelemetryConfig

_PROTOCOLS = get_args(OtlpConfig.model_fields["protocol"].annotation)
_FIXED_RATIOS = {"always_on": 1.0, "always_off": 0.0, "parentbased_always_on": 1.0, "parentbased_always_off": 0.0}
_RATIO_SAMPLERS = ("traceidratio", "parentbased_traceidratio")


def with_environment(config: TelemetryConfig, environ: Mapping[str, str]) -> TelemetryConfig:
    """`config` with each key the file left out taken from its OTEL_* variable, where one is set."""
    explicit, otlp = config.model_fields_set, config.otlp
    update: dict[str, Any] = {}
    if "service_name" not in explicit and (name := _service_name(environ)):
        update["service_name"] = name
    if "sampling_ratio" not in explicit and environ.get("OTEL_TRACES_SAMPLER"):
        update["sampling_ratio"] = _sampling_ratio(environ)
    otlp_update: dict[str, Any] = {}
    if "endpoint" not in otlp.model_fields_set and (endpoint := environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
        otlp_update["endpoint"] = endpoint
        if "enabled" not in otlp.model_fields_set:
            otlp_update["enabled"] = not _export_disabled(environ)
    if "protocol" not in otlp.model_fields_set and (protocol := environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")):
        if protocol not in _PROTOCOLS:
            raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} is none of {', '.join(_PROTOCOLS)}")
        otlp_update["protocol"] = protocol
    if otlp_update:
        update["otlp"] = otlp.model_copy(update=otlp_update)
    return config.model_copy(update=update) if update else config


def _service_name(environ: Mapping[str, str]) -> str | None:
    if name := environ.get("OTEL_SERVICE_NAME", "").strip():
        return name
    for pair in environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, _, value = pair.partition("=")
        if key.strip() == "service.name" and value.strip():
            return value.strip()
    return None


def _sampling_ratio(environ: Mapping[str, str]) -> float:
    sampler = environ["OTEL_TRACES_SAMPLER"].strip().lower()
    if sampler in _FIXED_RATIOS:
        return _FIXED_RATIOS[sampler]
    if sampler not in _RATIO_SAMPLERS:
        known = ", ".join([*_FIXED_RATIOS, *_RATIO_SAMPLERS])
        raise ConfigError(f"OTEL_TRACES_SAMPLER: {sampler!r} is not a sampler the gateway has ({known})")
    raw = environ.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    if not raw:
        return 1.0
    try:
        ratio = float(raw)
    except ValueError:
        ratio = float("nan")
    if not 0 <= ratio <= 1:  # also false for NaN
        raise ConfigError(f"OTEL_TRACES_SAMPLER_ARG: {raw!r} is not a ratio between 0 and 1")
    return ratio


def _export_disabled(environ: Mapping[str, str]) -> bool:
    return (
        environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
        or environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none"
    )
