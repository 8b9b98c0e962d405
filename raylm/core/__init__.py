"""The scheduler's world: requests, the paged KV-cache block manager with
prefix caching, and the continuous-batching scheduler."""
