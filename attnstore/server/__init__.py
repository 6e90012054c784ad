"""The daemon: the gRPC servicer over the store service, the server around it
(auth, health, reflection, metrics), its settings, and its life (load, serve, drain)."""
