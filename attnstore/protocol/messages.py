"""Conversions between the records both sides share and the wire messages of attnstore.v1."""

from __future__ import annotations

from typing import cast

from attnstore.protocol.records import Codec, MapDtype, NamespaceLayout, TokenLimits
from attnstore.protocol.v1 import attnstore_pb2 as pb


def layout_from_pb(layout: pb.Layout) -> NamespaceLayout:
    """A wire layout as a NamespaceLayout; empty dtype and codec take their defaults."""
    return NamespaceLayout(
        layers=layout.layers,
        heads=layout.heads,
        causal=layout.causal,
        hidden=layout.hidden,
        feature_dim=layout.feature_dim,
        # Any string from the wire: NamespaceLayout rejects values outside the Literal types.
        dtype=cast(MapDtype, layout.dtype or "float16"),
        codec=cast(Codec, layout.codec or "fp16"),
    )


def layout_to_pb(layout: NamespaceLayout) -> pb.Layout:
    """A NamespaceLayout as its wire message."""
    return pb.Layout(**layout.to_json_dict())


def limits_from_pb(message: pb.Namespace | pb.CreateNamespaceRequest) -> TokenLimits | None:
    """The token limits a message carries; None when it carries none (both 0: an older peer)."""
    if not message.HasField("limits") or not (message.limits.vocab_size and message.limits.max_length):
        return None
    return TokenLimits(message.limits.vocab_size, message.limits.max_length)


def limits_to_pb(limits: TokenLimits | None) -> pb.TokenLimits | None:
    """Token limits as their wire message (None: the field stays absent)."""
    return None if limits is None else pb.TokenLimits(vocab_size=limits.vocab_size, max_length=limits.max_length)
