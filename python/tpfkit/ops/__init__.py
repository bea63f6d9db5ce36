"""PyTorch custom ops over the C++ core."""
