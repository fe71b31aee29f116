"""`pretrain plan`: what it plans for (`target`), each rank's memory (`memory`, `layout`, `stages`),
step time (`timing`, `rates`, `evidence`, `published`), the layout search (`search`) and the report
(`report`). It reads the machines through cluster/ and never builds a model."""
