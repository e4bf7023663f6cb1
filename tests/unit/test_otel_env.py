"""The standard OTEL_* variables are defaults; what portcullis.yaml says overrides them."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, TelemetryConfig
from gateway.observability.otel_env import with_environment


def test_variables_fill_what_the_file_left_out() -> None:
    resolved = with_environment(
        TelemetryConfig(),
        {
            "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,service.name=from-resource",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0.25",
        },
    )
    assert resolved.service_name == "from-resource"
    assert (resolved.otlp.enabled, resolved.otlp.endpoint, resolved.otlp.protocol) == (
        True,
        "http://collector:4318",
        "grpc",
    )
    assert resolved.sampling_ratio == 0.25


def test_the_file_overrides_the_variables() -> None:
    written = TelemetryConfig.model_validate(
        {"service_name": "from-file", "sampling_ratio": 1, "otlp": {"enabled": False, "endpoint": "http://a:4318"}}
    )
    resolved = with_environment(
        written,
        {
            "OTEL_SERVICE_NAME": "from-env",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://b:4318",
            "OTEL_TRACES_SAMPLER": "always_off",
        },
    )
    assert resolved == written


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}, "OTEL_TRACES_SAMPLER_ARG"),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "nan"}, "OTEL_TRACES_SAMPLER_ARG"),
        ({"OTEL_TRACES_SAMPLER": "jaeger_remote"}, "OTEL_TRACES_SAMPLER"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
    ],
)
def test_a_value_that_cannot_be_used_is_refused_naming_its_variable(environ: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=f"^{named}: "):
        with_environment(TelemetryConfig(), environ)


def test_an_endpoint_with_the_sdk_disabled_does_not_turn_export_on() -> None:
    resolved = with_environment(
        TelemetryConfig(), {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}
    )
    assert not resolved.otlp.enabled
