"""How stages and the parameter server talk (docs/ps-protocol.md): the wire format (a msgpack header and raw
tensor frames, strictly validated), CurveZMQ key files and the rule binding a key to one virtual worker, and
which PS shard holds which key. Pure: bytes and plain data in and out; sockets live in hetpipe.server and
hetpipe.worker."""
