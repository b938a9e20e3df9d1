"""Training: the loop (loop.py, read top to bottom), the learning-rate schedule, checkpoints
(torch.distributed.checkpoint) and the distributed plumbing (process groups, torchrun)."""
