"""Models as ordered layer lists, so a stage can build only its own layers."""
