"""Thin helpers for the examples: config, launcher, data,
models, report, errors; the DDP lines stay in the scripts."""
