"""``attnstore build``: capture a corpus, train and calibrate the projector, ingest."""
