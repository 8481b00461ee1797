"""The model runtime shared by prefill and decode workers: models, loaders, tokenizer, paged KV cache and sampling."""
