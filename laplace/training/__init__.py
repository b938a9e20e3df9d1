"""Training: the loop (loop.py: the Trainer, whose fit reads top to bottom), the learning-rate schedule, checkpoints
(torch.distributed.checkpoint), the distributed plumbing (process groups, FSDP2, torchrun) and
the dry run of a distributed job (plan.py)."""
