"""Text to training batches, one module a stage: `corpus` (find and read documents), `clean` and
`dedup`, `tokenizer`, `shards` (checksummed binary token files), `dataset` (the manifest that ties
them together), `prepare` (the command that runs those stages) and `loader` (the resumable mmap
reader a rank trains from).

Only `loader` imports torch.
"""
