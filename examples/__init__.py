"""Examples of hetpipe used from outside: models of your own (README "Your own model")."""
