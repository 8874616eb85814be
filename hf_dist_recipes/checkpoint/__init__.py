"""Checkpoints in every layout: HuggingFace export from a live DeepSpeed model (`export`), the offline export of a
training checkpoint (`offline`), the sharded safetensors writer both use (`writer`), and the shard plan that lets
several ranks or processes write one checkpoint's files, each its share (`shard_plan`), and a resume that reads
DeepSpeed's files memory-mapped (`resume_loading`)."""
