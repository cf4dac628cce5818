"""Helpers every test package shares: child processes driven one JSON object a line."""
