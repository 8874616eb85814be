"""Practice 3: ZeRO-3 with tensor (and expert) parallelism, through DeepSpeed and accelerate configs."""

from hf_dist_recipes.parallel.batch import BatchFix, data_parallel_size, fix_tp_batch_size, tensor_parallel_size

__all__ = ["BatchFix", "data_parallel_size", "fix_tp_batch_size", "tensor_parallel_size"]
