"""What running a job takes and leaves, as plain logic: child processes owned by a launcher and stopped
together, JSONL metrics and Chrome traces, atomic checkpoint files with manifests, and the shaped-network
testbed as data (namespaces, addresses, links). The launchers in hetpipe.app and the runtimes call these."""
