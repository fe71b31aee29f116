"""The machines a run lands on: hostfiles and the launch environment (`launch`, `reach`), the
device's peak FLOP/s (`hardware`), DeepSpeed's ops (`ops`), the stdlib-only probe that runs on
every host (`probe`), the supervisor that restarts a run's ranks (`supervise`, `torchrun`), and
`pretrain plan`: what it plans for (`target`), memory (`memory`, `layout`, `plan`), step time
(`timing`, `rates`, `evidence`, `published`), the layout search (`search`) and the report
(`plan_report`).
"""
