"""Triton kernels for vllm-selfspec's hot paths, each beside its PyTorch reference and its test.

The engine uses the PyTorch reference path on CPU and wherever a kernel is not present yet.
"""
