"""rlbus.engines."""
