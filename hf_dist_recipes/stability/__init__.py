"""Practice 5: clip gradients (`gradients`), and never let a non-finite loss or gradient pass silently: what one does
(`nonfinite`: the policy and the report), loss and gradient-norm spikes (`spikes`), and the callback that watches
every step (`gradient_health`). Modules are imported directly; this package imports nothing."""
