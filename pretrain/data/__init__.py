"""Text to training batches, one module a stage: `sources` and `chunks` (find and read documents),
`corpus`, `clean` and `dedup`, `tokenizer`, `shards` (checksummed binary token files), `dataset`
(the manifest that ties them together), `prepare` (the command that runs those stages, with its
workers in `workers` and `encode`, its report in `report`, and `fingerprint`, which tells whether a
directory holds the dataset asked for) and `loader` (the resumable mmap reader a rank trains from).

Only `loader` imports torch.
"""
