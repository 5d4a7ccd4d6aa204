"""The model side: loading a model, the runner (a step's plan to tensors), the forward, CUDA graphs."""
