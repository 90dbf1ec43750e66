"""Data path: schema checks, materialization to the store, and per-rank readers."""
