"""Mixture-of-experts: tokens per routed expert counted across ranks (`expert_load`), and DeepSeek-V3's
auxiliary-loss-free bias balancing (`expert_balance`). Modules are imported directly; this package imports nothing."""
