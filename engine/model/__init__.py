"""The model side: loading a model, the runner (a step's plan to tensors), the forward, CUDA graphs.

Importing the package imports no torch: the engine's config reads the runner's choices from here.
"""

# on: decode steps replay CUDA graphs (CUDA only); off; eager: the graphs' buffers and padding,
# run without capture
CUDA_GRAPH_MODES = ("on", "off", "eager")
