"""The fused evaluation of ``dE/dg``: two large matrix products with a closed-form backward."""
