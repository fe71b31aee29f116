"""Training, on floors of its own (tests/test_layers.py): who the ranks are (`ranks`, with every
private DeepSpeed attribute in `ds_internals`), the GPT (`model`) and how a rank builds its part
(`tensor_parallel`, `pipeline`, `engine`), the checkpoint format (`checkpoint`), which one a run
continues from (`resume`) and the universal conversion (`universal`), `setup` (`run`), the loop
(`loop`), and a rank's life from start to exit (`entry`); around them the LR schedule, evaluation,
metrics, the guards and faults, the hang watchdog, and the run directory's record and lock.
"""
