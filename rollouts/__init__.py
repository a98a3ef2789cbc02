"""rollouts."""
