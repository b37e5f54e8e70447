"""Turns a scheduled batch into tensors, runs the model and samples."""
