"""The store service: a map store with its vector indexes, answering lookups tier by tier."""

from attnstore.service.service import AttnStoreService, IngestResult, MatchResult, Query

__all__ = ["AttnStoreService", "IngestResult", "MatchResult", "Query"]
