"""Fine-tuning on graded trajectories: `contexts` (the performer's exact prompts), `grading` (the
auditor and the supervisor judge a candidate in its trajectory's context), `datasets` (best-of-N
SFT, DPO pairs, GRPO prompts), `rewards` (the GRPO reward registry), `judged_rewards` (the
rewards graded by the auditor / supervisor, registered into it), `train_data` (loading and
checking a dataset for a trainer) and `trainer` (`lhd train`: TRL + PEFT, resumable).

`python -m lhd_train.finetune sft|dpo|grpo RECIPE` is the multi-GPU launch entry (accelerate,
slurm). Heavy imports (torch, transformers, trl) happen inside the functions."""
