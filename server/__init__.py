"""The parameter server: WSP shard state over a ZeroMQ ROUTER loop, checkpoints, shard launcher."""
