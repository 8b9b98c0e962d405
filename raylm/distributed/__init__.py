"""Process groups for tensor and pipeline parallelism, and the collectives the
model layers call; at world size 1 every collective is a no-op."""
