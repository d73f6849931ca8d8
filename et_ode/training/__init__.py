"""Training: one loop for every task, data-only checkpoints and model files, run folders, several processes."""
