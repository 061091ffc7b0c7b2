"""Where a run's metric records go: sinks (metrics.jsonl first), fed by one logger on rank 0."""

from lorakit.observe.metrics import JsonlSink, MetricsLogger, MetricsSink

__all__ = ["JsonlSink", "MetricsLogger", "MetricsSink"]
