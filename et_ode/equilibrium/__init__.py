"""Attractors: the certified fixed point of the flow, its Newton polish and certificate, and implicit gradients there."""
