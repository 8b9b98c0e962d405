"""K/V movement between engines: one package for every way a request's KV
cache blocks go from one engine's ranks to another's (live migration's
stages today; prefix pulls and P/D hand-offs will plug into the same
interface: see transport's docstring for what a new kind implements).

Modules:
- transport: the one interface the engine talks to (KVTransport), its two
  kinds (FileTransport, NetworkTransport), chosen once per migration
  (`transport_for`), and the supervisor's folder of stages (StageFolder);
- rank: a rank's side, the one object the worker's five transfer methods
  dispatch to, by the kind each call's route names;
- files: the blocks' layout, a transfer file's writing and reading (one
  node, through shared memory), and the same bytes packed in memory;
- network: a rank's endpoint for transfers between nodes, over the pieces
  frames (the wire, its buffers and ZMQ contexts), admission (who may
  connect, heartbeats, refusals), server (the source's offers) and fetch
  (the destination's side);
- sealed_frames: the seal (AES-256-GCM with a pre-shared key);
- background: the copies beside the steps and their CPU budget.
"""
