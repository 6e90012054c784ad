"""``attnstore report``: docs/RESULTS.md tables and plots from the eval JSON files."""
