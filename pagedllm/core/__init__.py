"""Scheduling policy and KV block bookkeeping. Nothing in here touches tensors."""
