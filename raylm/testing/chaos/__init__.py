"""The chaos harness: seeded schedules of faults and control operations
against the engine, with invariants checked after each (issue 48).

- `content_model`: a model whose tokens show the K/V they were computed
  over, and an executor that runs it (the fast tier's oracle);
- `sim`: the real supervisor and real engine cores on that model, every
  loop, copy, start and clock tick turned by the harness (the fast tier),
  on `sim_host`'s stand-ins for processes, sockets, threads and the clock;
- `schedule`: seeded schedules of real operations against real engine-core
  processes (the real-engine tier).

The tests that drive them are in tests/chaos/.
"""
