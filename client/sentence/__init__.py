"""What turns a model's last hidden states into sentence-transformers' results: the model's own
pooling and normalisation (``heads``) and ``encode()``'s options (``outputs``)."""
