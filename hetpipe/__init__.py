"""hetpipe: pipelined virtual workers over heterogeneous GPUs, synchronised by a WSP parameter server."""

__version__ = "0.1.0"
