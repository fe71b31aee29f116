"""The machines a run lands on: hostfiles and the launch environment (`launch`, `reach`), the
device's peak FLOP/s (`hardware`), DeepSpeed's ops (`ops`), the stdlib-only probe that runs on
every host (`probe`), and the supervisor that restarts a run's ranks (`supervise`, `torchrun`).
What a run needs of them is planned in plan/.
"""
