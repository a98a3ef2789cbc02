"""Fine-tuning on graded trajectories: `contexts` (the performer's exact prompts), `grading` (the
auditor and the supervisor judge a candidate in its trajectory's context), `datasets` (best-of-N
SFT, DPO pairs, GRPO prompts), `rewards` (the GRPO reward registry), `judged_rewards` (the
rewards graded by the auditor / supervisor, registered into it), `train_data` (loading and
checking a dataset for a trainer) and `trainer` (`lhd train`: TRL + PEFT, resumable).

Multi-GPU launches (accelerate, slurm) start the command line:
`accelerate launch ... -m lhd_train.cli train sft|dpo|grpo RECIPE`. Heavy imports (torch,
transformers, trl) happen inside the functions."""
