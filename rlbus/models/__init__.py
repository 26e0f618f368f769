"""rlbus.models."""
