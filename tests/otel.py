"""The session's OpenTelemetry providers, read in memory: the ``otel`` fixture (``tests/conftest.py``)
of ``tests/test_telemetry.py`` and ``tests/test_replace.py``.

OpenTelemetry's global providers can be set once per process: the first ``session_otel()``
sets them for the rest of the session (later tests run instrumented), and each test reads
what changed.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

__all__ = ["Otel", "session_otel"]


class Otel:
    """The session's in-memory metric reader and span exporter."""

    def __init__(self, reader: InMemoryMetricReader | None = None) -> None:
        self.reader = InMemoryMetricReader() if reader is None else reader
        self.spans = InMemorySpanExporter()

    def points(self, name: str) -> dict[tuple[tuple[str, Any], ...], Any]:
        """The cumulative data points of metric ``name``, by their sorted attributes."""
        data = self.reader.get_metrics_data()
        found: dict[tuple[tuple[str, Any], ...], Any] = {}
        for resource in data.resource_metrics if data is not None else []:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        for point in metric.data.data_points:
                            found[tuple(sorted((point.attributes or {}).items()))] = point
        return found

    def count(self, name: str, **attributes: str) -> float:
        """The sum of counter ``name``, or the count of histogram ``name``, at ``attributes``."""
        point = self.points(name).get(tuple(sorted(attributes.items())))
        if point is None:
            return 0
        return float(getattr(point, "count", None) or point.value)

    def total(self, name: str, **attributes: str) -> float:
        """The sum of the values of histogram ``name`` at ``attributes``."""
        point = self.points(name).get(tuple(sorted(attributes.items())))
        return 0.0 if point is None else float(point.sum)


_OTEL: list[Otel] = []


def session_otel() -> Otel:
    """The process's ``Otel``, set as OpenTelemetry's global providers on first use; its
    finished spans cleared."""
    if not _OTEL:
        otel = Otel()
        meter_provider = MeterProvider(metric_readers=[otel.reader])
        metrics.set_meter_provider(meter_provider)
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(SimpleSpanProcessor(otel.spans))
        trace.set_tracer_provider(tracer_provider)
        # Refused, with a mere warning, if something in this process set one first (an example's
        # worker_init receiver, say): the tests would read nothing.
        refused = metrics.get_meter_provider() is not meter_provider
        if refused or trace.get_tracer_provider() is not tracer_provider:
            raise RuntimeError("OpenTelemetry's global providers were set before the session's")
        _OTEL.append(otel)
    _OTEL[0].spans.clear()
    return _OTEL[0]
