"""The store service: a map store with its vector indexes, answering lookups tier by tier.

``service`` is the facade; ``exact_tier`` and ``map_tier`` decide each row of a
lookup; ``indexes`` keeps the vector indexes in step with the store; ``queries``
holds the records of a lookup.
"""

from attnstore.service.exact_tier import ROW_ERRORS, ExactOutputs
from attnstore.service.queries import IngestResult, MatchResult, Query
from attnstore.service.service import AttnStoreService

__all__ = ["ROW_ERRORS", "AttnStoreService", "ExactOutputs", "IngestResult", "MatchResult", "Query"]
