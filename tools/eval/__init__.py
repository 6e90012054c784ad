"""``attnstore eval ...``: task evaluations against the full model and the baselines."""
