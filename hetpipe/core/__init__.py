"""Core: the rules as pure logic over plain data, no torch and no processes of its own (docs/architecture.md).

Subpackages, each importing only those listed before it (tests/test_layers.py): `wsp` (one PS shard's Wave
Synchronous Parallel state, the aggregation rules, the audit ledger), `protocol` (the PS wire protocol, CURVE
keys and who may act as whom, which shard holds which key), `pipeline` (schedules as action lists, their
registry and dependency engine, staleness mitigations, resume positions), `config` (the cluster TOML as
validated frozen dataclasses), `hardware` (where each GPU computes, emulated speeds), `planning` (profiles,
the memory model, partitioner, allocation policies, simulator, planner and convergence model) and `runs`
(owned child processes, metrics and traces, checkpoint files, the network testbed). Beside them: `errors`
(errors that carry their remedy), `imports` (users' code named "package.module:attr") and `registry` (named
extension points).
"""
