"""Model families written in pagedllm's own layers, and their weight loaders."""
