"""Ray edges: generator actors, placement, the trajectory pool."""
