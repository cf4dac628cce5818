"""averaging package."""
