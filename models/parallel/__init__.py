"""Sharded and multi-process runs: ``mesh`` (the ("data", "model") mesh), ``rules`` (partition
rules), ``placement`` (values onto their shards), ``per_shard`` (decode steps under
shard_map), ``sharding`` (all of their names, and the rules table), ``distributed``
(jax.distributed runs), ``hlo_collectives`` (the collectives of a compiled program)."""
