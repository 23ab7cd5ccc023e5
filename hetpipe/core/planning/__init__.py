"""The planner (docs/planning.md, docs/memory.md, docs/convergence.md): per-layer profiles, the memory model
of a stage and a shard, the check that a run fits its GPUs, the partitioner of one virtual worker, the
allocation policies that group GPUs into VWs, what a plan is, the discrete-event simulator of a plan under
WSP, the search over groupings x splits x Nm x D x schedules with its baselines and output, and the
convergence model that ranks plans by predicted time to target. Pure: profiles in, plans and predictions
out."""
