"""Training: a queued run claimed, its snapshot replayed, an adapter trained or a harness
proposed, and registered."""
