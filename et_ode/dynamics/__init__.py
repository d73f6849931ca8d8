"""The dynamics: the vector field ``tau dx/dt = -dE/dg`` and the geometry of the token spheres."""
