"""``attnstore admin``: calls against a running daemon (``command``), with the cold start of an exact-tier
namespace (``cold_start``), a writer's entries dropped (``drop_writer``) and a projector trained from the
stored maps (``train_projector``)."""
