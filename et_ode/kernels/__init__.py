"""The fast evaluation of ``dE/dg`` (two large matrix products with a closed-form backward) and the native loop (the
whole adaptive solve of the ET's field in C)."""
