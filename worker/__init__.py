"""The virtual-worker runtime: PS client, stage executor, P2P transport, VW launcher."""
