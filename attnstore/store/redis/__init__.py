"""The Redis backend of the map store: entries on one Redis server or a Redis Cluster, shared by many daemons.

One Redis hash per entry (its record, every layer's stored objects, its outputs),
hash-tagged so the whole entry lives on one shard and is read in one command;
per-namespace index keys and a Stream logging ingests and deletes on the
namespace's shard, updated together by one Lua script; the catalog on one more.
See ``keys`` for the key layout and ``mapstore`` for the guarantees.
"""
