"""Kvasir's Grafana dashboards and Prometheus rules, built from code (`python -m
kvasir.observability.generate` writes dashboards/*.json and the chart's copies of both)."""
