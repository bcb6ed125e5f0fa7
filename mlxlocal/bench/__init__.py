"""Benchmarks: local engine runs and OpenAI-compatible endpoint runs."""
