"""Compute: the torch arithmetic of models, data, stages and the single-process reference. No sockets."""
