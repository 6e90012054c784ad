"""``attnstore node``: an inference node that serves embeddings over HTTP (import name ``attnstore_node``)."""
