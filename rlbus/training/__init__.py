"""The trainer's side of RL: scored-group batches, the GRPO step, checkpoints and the supervised warm start.

`batch` turns rollouts (engine results or `Rollout` messages) into padded tensors, `step` is one GRPO
update with the numerical-mismatch controls of docs/architecture.md §5, `trainer` owns the master model, its optimizer,
version numbering, publishing and checkpoints, `online_lane` is served traffic's queue, baseline and
release cadence, `checkpoint` makes restarts exact, and `sft` trains a policy on reference completions so
RL starts from a model that is sometimes right. The worker that drives them on the event loop is
`rlbus.consumers.trainer`.
"""
