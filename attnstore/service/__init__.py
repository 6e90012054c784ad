"""The store service: a map store with its vector indexes, answering lookups.

``service`` is the facade; ``exact_lookup`` and ``map_lookup`` decide each row of a
lookup (the daemon's side of the client's exact and map tiers); ``prefixes`` and ``chunks`` are its
parts for the prefix and chunk tiers; ``indexes`` keeps the vector indexes in step with the store; ``queries``
holds the records of a lookup.
"""

from attnstore.service.exact_lookup import ROW_ERRORS, ExactOutputs
from attnstore.service.queries import IngestResult, MatchResult, Query
from attnstore.service.service import AttnStoreService

__all__ = ["ROW_ERRORS", "AttnStoreService", "ExactOutputs", "IngestResult", "MatchResult", "Query"]
