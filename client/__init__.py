"""AttnStore inference-node library: model adapters, capture and replay, store connection."""
