"""The torch-level floor: device and dtype names, the process group, host settings, compilation.

Its modules import torch and ``specforge_core.errors`` only, so every other floor may use them.
"""
