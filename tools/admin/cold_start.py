"""``attnstore admin create-namespace``: an empty namespace for a model, filled from traffic.

Cold start: no corpus, no build. Run on a namespace that exists, it records the
model's token limits where the namespace has none (one made before they were:
write-back into it is refused until then), and so for a causal model its prefix
and chunk layouts (``--prefix-block-size``, ``--chunk-dtype``): a write token's
put never records one, so nodes write prefix blocks and chunks only into a
namespace that records them. The namespace gets the model's layout and
fingerprint and no projector, so it serves the exact tier alone; nodes that run
the model with a write token fill it by write-back (``AttnCache(write_back=True)``)
as traffic repeats. Map hits need a projector: ``admin train-projector``
(``attnstore_tools.admin.train_projector``) trains and installs one from the maps
written back and gives every stored entry its feature vector, after which map
hits start. (A corpus works too: ``attnstore build`` then ``admin ingest
--replace-projector``.)
"""

from __future__ import annotations

import argparse

from attnstore.protocol.chunks import ChunkDtype
from attnstore.protocol.prefix import DEFAULT_BLOCK_SIZE
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore_client.connection.daemon import DaemonClient
from attnstore_client.keys import model_fingerprint
from attnstore_client.models import LoadedModel, load_model
from attnstore_tools.build.namespace_layout import exact_tier_layout, kv_layouts, token_limits


def create_exact_namespace(
    remote: DaemonClient, loaded: LoadedModel, name: str, *, block_size: int = DEFAULT_BLOCK_SIZE,
    chunk_dtype: ChunkDtype = "float16",
) -> pb.Namespace:
    """Create (or find, if it exists with the same model and layout) an exact-tier-only namespace, with the
    model's token limits and, for a causal model, its prefix and chunk layouts (recorded too on an existing
    namespace made before them): prefix blocks of ``block_size`` tokens in the model's dtype, chunks in
    ``chunk_dtype`` (``ChunkSettings.dtype`` of the nodes that read them).

    Raises:
        NamespaceExistsError: ``name`` exists with another model or layout.
        AuthError: the token is not an admin token.
    """
    fingerprint = model_fingerprint(loaded.model, loaded.tokenizer)
    prefix, chunks = kv_layouts(loaded, block_size=block_size, chunk_dtype=chunk_dtype)
    return remote.create_namespace(name, model=loaded.name, fingerprint=fingerprint, layout=exact_tier_layout(loaded),
                                   limits=token_limits(loaded), prefix=prefix, chunks=chunks)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``admin create-namespace``."""
    parser.add_argument("--model", required=True, help="model alias (minilm, smollm2) or local model path")
    parser.add_argument("--namespace", required=True, help="name of the namespace to create")
    parser.add_argument("--prefix-block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                        help=f"tokens per prefix block of a causal model (default {DEFAULT_BLOCK_SIZE})")
    parser.add_argument("--chunk-dtype", default="float16", choices=["float16", "float32"],
                        help="how a causal model's chunks are kept (default float16, the chunk tier's; nodes read"
                        " them with ChunkSettings(dtype=...) of the same)")


def run(args: argparse.Namespace, remote: DaemonClient) -> pb.Namespace:
    """Create the namespace ``args`` name for ``args.model``."""
    return create_exact_namespace(remote, load_model(args.model), args.namespace, block_size=args.prefix_block_size,
                                  chunk_dtype=args.chunk_dtype)
