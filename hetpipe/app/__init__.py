"""Application: what the commands run on top of the runtime (the local train launcher, plan inputs)."""
