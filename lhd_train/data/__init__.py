"""Training data from audited runs: contexts, grading, best-of-N SFT, DPO pairs, GRPO prompts and rewards."""
