"""The checkpoint wing: the bytes of a checkpoint and the background save (`files`), the format, the
atomic commit, retention and safe loading (`store`), which checkpoint a run continues from (`resume`),
and the conversion to another world size (`universal`)."""
