"""Rollouts: bank tasks as environments, episodes sampled and verified, the curriculum, and
the serving process's lane that runs them."""
