"""Thin helpers shared by the numbered examples.

Only what would otherwise be copied into every script lives here: launcher
detection, process-group setup, data sets, models, config and rank-0 reporting.
The DDP lines a reader should study stay in the example scripts themselves.
"""
