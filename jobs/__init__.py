"""Ray Job entrypoints: parse, validate, run the trajectory pool, write results."""
