"""What an adapter can do beyond running its model's own forward: the tiers ask these, never a family name.

Every adapter runs the model's own forward on a right-padded batch (the exact
tiers, write-back of outputs and the compute tier need nothing more). The rest
needs an adapter that knows the model's attention modules:

- ``can_replay``: capture and replay attention maps (the map tier, maps written
  back with a row, the projector's feature source, ``attnstore build``'s maps);
- ``can_pack``: packed forwards, rows end to end with nothing padded
  (``adapters.packed``); without it a call's rows run in length-sorted padded
  batches;
- ``can_share_kv``: run a suffix on stored keys and values (the prefix and chunk
  tiers, for a causal model; off where the adapter knows its model cannot, as
  under a sliding window).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What an adapter can do beyond the model's own forward (see the module docstring).

    ``missing`` says why what is off is off (empty when everything is on): it ends up in the load's log line and in
    ``AttnCache.tiers``.
    """

    can_replay: bool = True  # capture and replay attention maps
    can_pack: bool = True  # packed forwards
    can_share_kv: bool = True  # prefix and chunk tiers (of a causal model; not under a sliding window)
    missing: str = ""  # why the capabilities that are off are off

    @property
    def complete(self) -> bool:
        """Whether every capability is on."""
        return self.can_replay and self.can_pack and self.can_share_kv


# What the adapters of the families (``bert``, ``llama``) can do.
FULL = Capabilities()
