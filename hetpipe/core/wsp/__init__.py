"""Wave Synchronous Parallel at the parameter server (docs/wsp.md): one shard's state machine (registrations,
idempotent pushes, clocks over the live virtual workers, the gate, exact and latest pulls, eviction and
rejoin, snapshots), the aggregation rules that fold a wave's pushes into the global weights, and the
tagged-update ledger that audits guarantees L and G. Pure numpy; the socket loop lives in hetpipe.server."""
