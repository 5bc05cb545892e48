"""File formats read: safetensors, checkpoints, the one door (``open``), dtypes, paths, corpora."""
