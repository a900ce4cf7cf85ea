"""Benchmarks of pagedkv, run from the repository root as ``python -m bench.NAME`` (docs/benchmarks.md).

They measure the product through its own launchers and clients (``frontend/launch``,
``frontend/clients``); what they share lives in the product or in a module here, never in a copy.
"""
