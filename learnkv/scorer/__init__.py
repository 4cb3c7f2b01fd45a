"""The learned scorer: a plain per-layer MLP (`model`), its versioned artifact (`artifact`), its training (`module`)."""
