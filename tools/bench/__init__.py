"""``attnstore bench ...``: benchmarks that print a table and write JSON."""
