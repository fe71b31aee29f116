"""The model wing: the GPT as a plain `nn.Module` (`gpt`), and the weights a run starts from when
`model.init_from` names a Hugging Face model (`init_from`). No DeepSpeed and no process group here."""
