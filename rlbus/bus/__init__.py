"""rlbus.bus."""
