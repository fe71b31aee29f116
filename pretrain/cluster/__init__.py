"""The machines a run lands on: the launcher's environment and hostfiles (`launch`), the device's
peak FLOP/s (`hardware`), the stdlib-only probe that runs on every host (`probe`), the plan
that sizes a run for a cluster (`plan`), and the supervisor that restarts a run's ranks (`supervise`).
"""
