"""The engine every method runs on: the per-model runtime (reader, caches, staging, read-ahead), its
counters (`FlashStats`) and the unit trace."""
