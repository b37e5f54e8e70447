"""Building blocks of the models, written for the paged KV cache."""
