"""Training: the GPT (`model`), the DeepSpeed engine around it (`engine`), the LR schedule, the
loop (`loop.train`), evaluation, checkpoints, metrics, the hang watchdog, the guards that keep
ranks in step, and the run directory's record and lock (`rundir`).
"""
