"""rlbus.consumers."""
