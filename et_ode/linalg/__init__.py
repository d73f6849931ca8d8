"""Krylov methods on per-sample symmetric operators: Lanczos and conjugate gradients."""
