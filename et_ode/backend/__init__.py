"""The machine: devices, seeds and ranks, the CPU's code paths and threads, and the argument checks every layer uses."""
