"""Engine: the DeepSpeed config, process groups, the training loop, checkpoint-free saving."""
