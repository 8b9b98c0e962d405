"""K/V movement between engines: one package for every way a request's KV
cache blocks go from one engine's ranks to another's (live migration's
stages today; prefix pulls and P/D hand-offs will plug in the same way).

Modules:
- files: the blocks' layout, a transfer file's writing and reading (one
  node, through shared memory), and the same bytes packed in memory;
- network: a rank's endpoint for transfers between nodes, over the pieces
  frames (the wire, its buffers and ZMQ contexts), admission (who may
  connect, heartbeats, refusals), server (the source's offers) and fetch
  (the destination's side);
- sealed_frames: the seal (AES-256-GCM with a pre-shared key);
- background: the copies beside the steps and their CPU budget.
"""
