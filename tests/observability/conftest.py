"""Fixtures for the observability tests: tracing on, into an in-memory exporter, for one test.

`spans` installs an SDK TracerProvider (always sampling, spans handed over synchronously as
they end) for the test's duration through dspark.observability.tracing.use_tracer_provider,
and yields its InMemorySpanExporter; the process's previous tracing state is restored after.
`serve` and `tiny_model_dir` (tests/services/conftest.py): real gRPC servers, the tiny model as a directory.
"""

from __future__ import annotations

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dspark.observability import tracing
from tests.services.conftest import serve, tiny_model_dir  # noqa: F401 - fixtures (module docstring)

# A W3C traceparent a client might send: trace 4bf9..., parent span 00f0..., sampled.
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"


def in_memory_provider(exporter: InMemorySpanExporter, service_name: str = "dspark-test") -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = in_memory_provider(exporter)
    with tracing.use_tracer_provider(provider):
        yield exporter
    provider.shutdown()


def by_name(finished, name: str) -> list:
    """The finished spans called `name`."""
    return [s for s in finished if s.name == name]


def the_span(finished, name: str, kind=None):
    """The one finished span called `name` (of `kind`, if given)."""
    matching = [s for s in by_name(finished, name) if kind is None or s.kind == kind]
    assert len(matching) == 1, f"expected one {name!r} span, got {len(matching)} of {sorted({s.name for s in finished})}"
    return matching[0]
