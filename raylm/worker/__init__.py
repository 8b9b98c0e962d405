"""What runs on each model rank: the Worker (device, distributed init, KV
cache), its ModelRunner (batch preparation, forward) and the Sampler."""
