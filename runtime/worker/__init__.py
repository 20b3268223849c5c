"""The accelerator's side of a step (all torch): the model runner, its step inputs, CUDA graphs, kernel warm-up and CPU threads."""
