"""Process groups for tensor and pipeline parallelism, the collectives the
model layers call (a no-op at world size 1; shared memory between ranks of a
CPU node), the shared-memory/ZMQ broadcast queue that carries each step, and
CURVE authentication for the TCP sockets."""
