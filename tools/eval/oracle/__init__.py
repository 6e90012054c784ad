"""``attnstore eval oracle`` and ``eval corpora``: the projector judged against the oracle entry."""
