"""The distributed wing: who this process is and the host-side collectives (`ranks`, every private
DeepSpeed attribute in `ds_internals`), and how a rank builds its part of the model and hands it to
DeepSpeed: tensor parallel (`tensor_parallel`), pipeline stages (`pipeline`), `deepspeed.initialize`
(`engine`)."""
