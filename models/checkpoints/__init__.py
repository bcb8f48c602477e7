"""Checkpoint formats: readers of the files from_pretrained loads."""
