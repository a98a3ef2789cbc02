"""Fine-tuning on graded trajectories: `contexts` (the performer's exact prompts), `grading` (the
auditor and the supervisor judge a candidate in its trajectory's context), `datasets` (best-of-N
SFT, DPO pairs, GRPO prompts), `rewards` (the GRPO reward registry), `judged_rewards` (the
rewards graded by the auditor / supervisor, registered into it), `train_data` (loading and
checking a dataset for a trainer), `records` (the dataset and adapter folders' records) and
`trainer` (`lhd train`: TRL + PEFT, resumable, any algorithm of `config.algos.ALGOS`).

Multi-GPU launches (accelerate, slurm) start the command line:
`accelerate launch ... -m lhd_train.cli train ALGO RECIPE`. Heavy imports (torch,
transformers, trl) happen inside the functions."""
