"""hetpipe: pipelined virtual workers over heterogeneous GPUs, synchronised by a WSP parameter server."""

from pathlib import Path as _Path

from hetpipe import _checkout

__version__ = "0.1.0"

_checkout.install(_Path(__file__).resolve().parent)
