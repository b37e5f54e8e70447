"""Capacity planner (``pagedllm plan``): replays a request trace through the real scheduler,
KV cache manager and block pool with no model, timing steps with a calibrated cost model."""
