"""rlbus.rl."""
