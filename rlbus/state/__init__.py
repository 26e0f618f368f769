"""rlbus.state."""
