"""A row's feature, computed alike by clients and daemons: the projector over the row's input embedding.

``projector`` holds the projector (the client projects rows to search them; the
build trains it); ``embedding_layer`` the model's embedding stage, stored with a
namespace's projector so a daemon derives a written-back row's feature from its
tokens instead of taking the sender's. Both import torch: a daemon imports them
only once it derives a feature.
"""
