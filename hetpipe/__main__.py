"""`python -m hetpipe` runs the CLI."""

from hetpipe.cli import main

main()
