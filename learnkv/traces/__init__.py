"""Attention traces: the training data of the learned scorer (features, future-utility labels, teacher scores)."""
