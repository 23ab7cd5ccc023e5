"""The GPUs a config declares, as the runtime uses them: on which device each computes (a CUDA index, or the
CPU) and, under emulation, how much slower each runs and how links are delayed (docs/emulation.md). Pure: the
caller says how many devices and cores it has."""
