"""Inside a virtual worker (docs/schedules.md): pipeline schedules as per-stage action lists, registered by
name with their traits (the one registry every consumer reads), the dependency rules the validator, timing
model, simulator, reference and runtime all run by, staleness mitigations, and where a stopped run resumes or
an evicted VW rejoins on those lists. Pure."""
