"""Checkpoints in every layout: HuggingFace export from a live DeepSpeed model (`export`), the offline export of a
training checkpoint (`offline`), and the sharded safetensors writer both use (`writer`)."""
