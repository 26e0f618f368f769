"""rlbus.weights."""
