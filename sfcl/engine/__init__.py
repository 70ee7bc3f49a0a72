"""Engine: requests, scheduler (torch-free), KV cache, model runner, engine thread."""
