"""A namespace's projector: what clients and daemons must compute alike, kept out of the wire protocol.

- ``network``: the projector (a row's feature source -> a d = 128 vector; the client projects rows
  to search them, the build trains it);
- ``embedding_layer``: the model's embedding stage, stored with the projector so a daemon derives a
  written-back row's feature from its tokens instead of taking the sender's;
- ``blob``: the projector as safetensors bytes, whose metadata carries ``gate`` (the fidelity gate the
  daemon applies to map hits) and ``int8_plan`` (the linear layers a client may run in int8).

Both sides import it (the daemon checks and applies a blob; the client loads the projector and its int8
plan), so it sits beside ``attnstore.protocol`` and imports only ``attnstore.errors``: the client may
import it (pyproject.toml's contracts). ``blob``, ``gate`` and ``int8_plan`` import numpy and
safetensors; ``network`` and ``embedding_layer`` torch, so a daemon imports them only once it derives
a feature.
"""
