"""rlbus.schemas."""
