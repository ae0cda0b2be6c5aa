"""The ways a Llama-family forward runs: `eager` (the torch forward), `native` (the C++ step, a few tokens on the
CPU), `cuda_graphs` (captured short forwards on CUDA). They depend on the weights and the forward, never on
`LlamaLM`, which picks among them per shape."""
