"""Evaluation: metric modules (ROUGE, exact match, accuracy) that `evaluate` loads offline, by path."""

from lorakit.evaluation.scoring import METRICS, compute_metrics, load_metric, metric_path

__all__ = ["METRICS", "compute_metrics", "load_metric", "metric_path"]
