"""lens."""
