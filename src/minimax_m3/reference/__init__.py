"""The pure-PyTorch reference backend (CPU or CUDA): the torch model over ``ops``, its caches, torch.distributed
TP/EP, the step provider of the one generation loop, and ``minimax-m3 golden``, whose logits grade every other
backend."""
