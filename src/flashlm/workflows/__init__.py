"""Workflows that run a model end to end and write results beside it: `calibrate` (the sparse methods'
calibration) and `prune` (Wanda pruning for Endor)."""
