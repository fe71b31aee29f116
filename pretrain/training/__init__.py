"""Training, in wings by job (tests/test_layers.py holds their floors): the model (`model/`), the ranks
and how each builds its part under DeepSpeed (`distributed/`), checkpoints (`checkpoint/`), and here
the loop's own modules: `setup` (`run`), the loop (`loop`), a rank's life from start to exit (`entry`),
and around them the LR schedule, evaluation, metrics, the guards and faults, the hang watchdog, and
the run directory's record and lock.
"""
