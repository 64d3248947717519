"""Training recipes: one readable file per recipe, hyperparameters in YAML beside it."""
