"""generation."""
