"""Inference engine shared by Serve and batch generation: static KV cache, prefill + decode, sampling, continuous batching."""
