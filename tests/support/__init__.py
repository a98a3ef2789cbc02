"""Test helpers, not part of the library: a scripted backend, synthetic run directories, a
headless-browser client, the lens toy models and the autograd Jacobian baseline."""
