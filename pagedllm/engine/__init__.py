"""The engine loop: requests in, scheduler + model runner per step, outputs out."""
