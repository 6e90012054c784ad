"""The prefix tier of causal models: stored keys and values of a prompt's first blocks, the forward on the rest.

- ``tier``: which rows may start from a stored prefix, and the forward on a
  suffix with the prefix's keys and values streamed in as its past;
- ``serve``: the tier itself, ``PrefixTier`` (rows grouped by stored prefix
  length, failures left to the compute tier);
- ``capture``: the blocks of prompts computed by the model (what ``attnstore
  build --prefix-blocks`` stores);
- ``shared``: rows of a call sharing a prefix no store holds, the prefix computed once;
- ``writer``: with write-back on, those prefixes stored as blocks (``PrefixWriter``).
"""

from attnstore_client.tiers.prefix.capture import capture_prefix_blocks, prefix_layout_of
from attnstore_client.tiers.prefix.serve import PrefixTier
from attnstore_client.tiers.prefix.tier import forward_with_prefix
from attnstore_client.tiers.prefix.writer import PrefixWriter, PrefixWriterSettings, PrefixWriterStats

__all__ = ["PrefixTier", "PrefixWriter", "PrefixWriterSettings", "PrefixWriterStats", "capture_prefix_blocks",
           "forward_with_prefix", "prefix_layout_of"]
