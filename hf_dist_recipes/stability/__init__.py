"""Practice 5: clip gradients (`gradients`), and never let a non-finite loss or gradient pass silently, with loss and
gradient-norm spikes named (`gradient_health`). Modules are imported directly; this package imports nothing."""
